package outbox

import (
	"context"
	"time"
)

// retain deletes published rows past the retention window, in small batches
// so that no statement holds many locks or runs long.
func (r *Relay) retain(ctx context.Context) {
	t := time.NewTicker(r.cfg.RetentionInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := deleteExpired(ctx, r.pool, r.cfg.Retention, r.cfg.RetentionBatch, r.cfg.failpoint)
		if err != nil && ctx.Err() == nil {
			r.log.Warn("outbox retention failed", "err", err)
		} else if n > 0 {
			r.log.Debug("outbox retention deleted published events", "events", n)
		}
	}
}
