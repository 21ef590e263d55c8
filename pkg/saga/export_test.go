package saga

import "context"

// FireOne is fire for the external tests: fire one due timeout in a
// transaction of its own and say whether one fired. Only tests see it;
// `go doc` never does.
func (s *Scanner) FireOne(ctx context.Context) (bool, error) {
	n, err := s.fire(ctx, 1)
	return n > 0, err
}

// Fire is fire for the external tests: fire up to limit due timeouts in one
// transaction and return how many fired.
func (s *Scanner) Fire(ctx context.Context, limit int) (int, error) { return s.fire(ctx, limit) }
