package reconcile

import (
	"errors"
	"fmt"
	"slices"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/pkg/outbox"
)

// flows are the event flows about an order (docs/events.md): the producer
// whose outbox holds the event, and the consumer that must process it.
var flows = []struct{ producer, service, consumer string }{
	{"order", "inventory", "inventory-orders"},
	{"inventory", "order", "order-inventory"},
	{"order", "payment", "payment-orders"},
	{"payment", "order", "order-payment"},
	{"order", "fulfillment", "fulfillment-orders"},
	{"fulfillment", "order", "order-fulfillment"},
}

// repair republishes, for each order found (up to cfg.Limit), the events
// about it that one service published and the consumer that should have
// acted on them never processed.
func (r *run) repair() error {
	var orders []string
	for _, f := range r.findings {
		if f.Kind == LostEvent {
			continue // repaired by repairLost; the order need not be stuck
		}
		if !slices.Contains(orders, f.OrderID) {
			orders = append(orders, f.OrderID)
		}
	}
	if len(orders) > r.cfg.Limit {
		orders = orders[:r.cfg.Limit]
	}
	for _, id := range orders {
		for _, fl := range flows {
			n, err := r.republishLost(id, fl.producer, fl.service, fl.consumer)
			if err != nil {
				return err
			}
			r.repaired[id] += n
			r.total += n
		}
	}
	return nil
}

// republishLost republishes producer's published events of order id that
// consumer (in service's schema) has not processed, oldest first.
func (r *run) republishLost(id, producer, service, consumer string) (int, error) {
	producerPool, err := r.pools.Of(producer)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	servicePool, err := r.pools.Of(service)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	rows, err := producerPool.Query(r.ctx, `
		SELECT event_id FROM outbox
		WHERE aggregate_type = 'order' AND aggregate_id = $1 AND dead_at IS NULL
		  AND published_at < now() - $2 * interval '1 microsecond'
		  AND ($3::text[] IS NULL OR event_type = ANY($3)) -- only what the consumer reads
		ORDER BY aggregate_seq`, id, micros(r.cfg.RepublishAfter), verify.ConsumedTypes(consumer))
	if err != nil {
		return 0, fmt.Errorf("reconcile: %s events of order %s: %w", producer, id, err)
	}
	published, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil || len(published) == 0 {
		return 0, wrap(producer+" events of order "+id, err)
	}
	// Handled: processed, or parked as an open dead letter (a copy would
	// only fail the same way and park again).
	rows, err = servicePool.Query(r.ctx, `
		SELECT event_id FROM processed_events WHERE consumer_name = $1 AND event_id = ANY($2)
		UNION
		SELECT event_id FROM dead_letters WHERE consumer_name = $1 AND event_id = ANY($2) AND resolved_at IS NULL`,
		consumer, published)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %s processed events: %w", consumer, err)
	}
	processed, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return 0, fmt.Errorf("reconcile: %s processed events: %w", consumer, err)
	}
	n := 0
	// In sequence order: the relay publishes an event only when every
	// earlier one of its aggregate is published, so republishing seq 2
	// before seq 3 keeps their copies in order.
	for _, ev := range published {
		if slices.Contains(processed, ev) {
			continue
		}
		err := outbox.Republish(r.ctx, producerPool, ev)
		if errors.Is(err, outbox.ErrNotFound) {
			continue // republished meanwhile (another reconciler), or deleted by retention
		}
		if err != nil {
			return n, fmt.Errorf("reconcile: %w", err)
		}
		n++
	}
	return n, nil
}
