package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// wake wakes the relay to look for new events now. It never blocks. One
// waiting worker wakes; busy workers look again anyway when they finish a
// full batch.
func (r *Relay) wake() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// listen turns NOTIFYs on the schema's channel into kicks. It holds one
// connection of its own; if that fails, polling carries on until it is back.
func (r *Relay) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		r.log.Warn("outbox listen failed; polling until it is back", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(r.cfg.PollInterval):
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{"outbox." + r.schema}.Sanitize()); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return fmt.Errorf("wait for notification: %w", err)
		}
		if r.handOff() > 0 {
			continue // ModeCDC: the stream finds new events; the poller only old ones
		}
		r.wake()
		// Writers coalesce their NOTIFYs; a transaction that skipped its own
		// may commit just after the one that woke us. Look once more.
		time.AfterFunc(notifyFollowUp, r.wake)
	}
}

// notifyFollowUp is how long after a wake-up the relay looks again. Writer
// NotifyIntervals at or below it add no latency beyond it.
const notifyFollowUp = 25 * time.Millisecond
