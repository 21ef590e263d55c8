package saga

import "context"

// FireOne is fireOne for the external tests: fire one due timeout and say
// whether one fired. Only tests see it; `go doc` never does.
func (s *Scanner) FireOne(ctx context.Context) (bool, error) { return s.fireOne(ctx) }
