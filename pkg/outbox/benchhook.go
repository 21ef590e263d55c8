//go:build shopbench

package outbox

import (
	"context"

	"github.com/google/uuid"
)

// ClaimAndMark claims one batch and marks it published without publishing
// anything: the relay's database work alone, which internal/benchsuite
// measures as the relay's database-only ceiling. It returns how many events
// it marked.
//
// It exists only in builds with the shopbench tag (make bench, make test),
// so that no program built from this package can mark events published that
// were never sent.
func (r *Relay) ClaimAndMark(ctx context.Context) (int, error) {
	token := uuid.New()
	batch, err := r.claim(ctx, token)
	if err != nil || len(batch) == 0 {
		return 0, err
	}
	return len(batch), r.settle(ctx, token, batch, make([]result, len(batch)))
}
