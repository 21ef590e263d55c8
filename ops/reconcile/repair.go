package reconcile

import (
	"errors"
	"fmt"
	"slices"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/outbox"
)

// flow is an event flow: the producer whose outbox holds the events, and a
// consumer (of service) that must process those of them it reads (types;
// nil: all).
type flow struct {
	producer, service, consumer string
	types                       []string
}

// flows are the shop's event flows, one per consumer in the registry.
func (r *run) flows() []flow {
	var flows []flow
	for _, c := range r.shop.Services.Readers() {
		producer, _ := r.shop.Services.Owner(c.Stream) // Validate: every stream read has an owner
		flows = append(flows, flow{producer: producer.Name, service: c.Service, consumer: c.Name, types: c.Types})
	}
	return flows
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
		for _, fl := range r.flows() {
			n, err := r.republishLost(id, fl)
			if err != nil {
				return err
			}
			r.repaired[id] += n
			r.total += n
		}
	}
	return nil
}

// republishLost republishes the producer's published events of order id
// that the flow's consumer has not processed, oldest first.
func (r *run) republishLost(id string, fl flow) (int, error) {
	producer, consumer := fl.producer, fl.consumer
	producerPool, err := r.shop.Pool(producer)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	servicePool, err := r.shop.Pool(fl.service)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	rows, err := producerPool.Query(r.ctx, `
		SELECT event_id FROM outbox
		WHERE aggregate_type = 'order' AND aggregate_id = $1 AND dead_at IS NULL
		  AND published_at < now() - $2 * interval '1 microsecond'
		  AND ($3::text[] IS NULL OR event_type = ANY($3)) -- only what the consumer reads
		ORDER BY aggregate_seq`, id, micros(r.cfg.RepublishAfter), fl.types)
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
