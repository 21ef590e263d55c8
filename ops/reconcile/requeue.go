package reconcile

import (
	"fmt"
	"strings"

	"github.com/shop-ref/shop/pkg/outbox"
)

// outageDeath is how a relay before this version recorded an event it made
// dead because its stream was missing (an empty cluster, a deleted stream):
// the broker's loss, not the event's. Relays now wait such a stream out
// (pkg/outbox, "no stream"), so only events dead from before can match.
const outageDeath = "no stream for subject"

// requeueBatch bounds the dead events a run reads per service.
const requeueBatch = 1000

// requeueOutageDeaths puts back every dead event of every service that
// died of a missing stream: nothing was wrong with it, and until it goes
// out, its aggregate's later events wait behind it (orders closed by
// timeouts, or stuck). Dead events of any other cause stay for an
// operator (`shop outbox dead`).
func (r *run) requeueOutageDeaths() error {
	for _, name := range r.shop.Services.Names() {
		pool, err := r.shop.Pool(name)
		if err != nil {
			return fmt.Errorf("reconcile: %w", err)
		}
		dead, err := outbox.ListDead(r.ctx, pool, requeueBatch)
		if err != nil {
			return fmt.Errorf("reconcile: dead events of %s: %w", name, err)
		}
		for _, ev := range dead {
			if ev.LastError == nil || !strings.Contains(*ev.LastError, outageDeath) {
				continue
			}
			if err := outbox.Requeue(r.ctx, pool, ev.EventID); err != nil {
				return fmt.Errorf("reconcile: requeue %s event %s: %w", name, ev.EventID, err)
			}
			r.requeued = append(r.requeued, Requeued{Service: name, EventID: ev.EventID.String(), Type: ev.Type, AggregateID: ev.AggregateID})
		}
	}
	return nil
}

// Requeued is a dead event a run put back: it had died of a missing
// stream.
type Requeued struct {
	Service, EventID, Type, AggregateID string
}
