package outbox

import (
	"context"
	"time"
)

// A relay that dies holding claims would leave them for the rest of their
// lease (15 s by default): an event committed just before a crash would go
// out a lease later, the order it belongs to standing still. So a relay
// also says it is alive, in outbox_relays under its
// Name (the name its claims carry in claimed_by), every aliveEvery for
// aliveFor. A claim whose relay said so and has stopped saying so is free
// at once, whatever its lease: a relay restarted after a crash, or any
// live one, takes it over within aliveFor. A claim whose relay never said
// so (a version before this one) keeps its lease.
//
// A relay that is alive but cannot renew (its database connection lost for
// longer than aliveFor) may lose its claims while it publishes: the same
// window as a lease that expires mid-batch. Its marks then match no row
// (the claim token fences them), and what it published goes out again
// under the same ids.
const (
	aliveFor   = 3 * time.Second
	aliveEvery = time.Second
)

// heartbeatSQL also records, for the relay that streams a slot ($3, else
// ”), when it was last caught up ($4): ReadSlot's LagAge.
const heartbeatSQL = `
WITH gone AS (DELETE FROM outbox_relays WHERE alive_until < now() - interval '1 minute'),
caught_up AS (
	INSERT INTO outbox_slots (slot, caught_up_at) SELECT $3, $4 WHERE $3 <> ''
	ON CONFLICT (slot) DO UPDATE SET caught_up_at = GREATEST(outbox_slots.caught_up_at, EXCLUDED.caught_up_at))
INSERT INTO outbox_relays (name, alive_until) VALUES ($1, now() + $2 * interval '1 microsecond')
ON CONFLICT (name) DO UPDATE SET alive_until = EXCLUDED.alive_until`

// claimantGoneSQL is true for a row claimed by a relay that said it was
// alive and has stopped: its claim is free.
const claimantGoneSQL = `EXISTS (SELECT 1 FROM outbox_relays r WHERE r.name = o.claimed_by AND r.alive_until < now())`

// stayAlive renews the relay's row until ctx ends, then deletes it: a
// clean stop has settled every batch it claimed.
func (r *Relay) stayAlive(ctx context.Context) {
	t := time.NewTicker(aliveEvery)
	defer t.Stop()
	for {
		slot, caughtUp := "", time.Now()
		if at := r.cdc.caughtUpAt.Load(); at != 0 && r.cdc.streaming.Load() {
			slot, caughtUp = r.slot, time.Unix(0, at)
		}
		if _, err := r.pool.Exec(ctx, heartbeatSQL, r.cfg.Name, aliveFor.Microseconds(), slot, caughtUp); err != nil && ctx.Err() == nil {
			r.log.Debug("outbox relay: cannot say it is alive", "err", err)
		}
		select {
		case <-ctx.Done():
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			_, _ = r.pool.Exec(ctx, `DELETE FROM outbox_relays WHERE name = $1`, r.cfg.Name)
			return
		case <-t.C:
		}
	}
}
