package fulfillment

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/pkg/outbox"
)

// Shipment states.
const (
	StateStarted   = "STARTED"
	StateDelivered = "DELIVERED"
)

// Shipment is one order's shipment.
type Shipment struct {
	OrderID     uuid.UUID  `json:"order_id"`
	ShipmentID  uuid.UUID  `json:"shipment_id"`
	State       string     `json:"state"`
	Items       []Item     `json:"-"`
	StartedAt   time.Time  `json:"started_at"`
	DeliverAt   time.Time  `json:"deliver_at"`
	DeliveredAt *time.Time `json:"delivered_at"` // null until delivered
}

// ErrNotFound means there is no shipment for the order.
var ErrNotFound = errors.New("fulfillment: shipment not found")

// startShipment inserts the order's shipment, due Delay from now, and its
// FulfillmentStarted event, both in tx. A shipment that exists already (a
// second OrderPaid for the order) is left alone and nothing is emitted:
// started reports false.
func (s *Service) startShipment(ctx context.Context, tx pgx.Tx, p paid) (started bool, err error) {
	shipmentID, err := uuid.NewV7()
	if err != nil {
		return false, fmt.Errorf("new shipment id: %w", err)
	}
	items, err := json.Marshal(p.items)
	if err != nil {
		return false, fmt.Errorf("encode items: %w", err)
	}
	sh := Shipment{OrderID: p.orderID, ShipmentID: shipmentID, State: StateStarted, Items: p.items}
	// deliver_at comes from the database clock, the same clock the scanner
	// compares it with, so clock skew between instances cannot shift it.
	err = tx.QueryRow(ctx, `
		INSERT INTO shipments (order_id, shipment_id, state, items, started_at, deliver_at, trace_headers)
		VALUES ($1, $2, 'STARTED', $3, now(), now() + $4 * interval '1 microsecond', $5)
		ON CONFLICT (order_id) DO NOTHING
		RETURNING started_at, deliver_at`,
		p.orderID, shipmentID, items, s.cfg.Delay.Microseconds(), traceHeaders(ctx),
	).Scan(&sh.StartedAt, &sh.DeliverAt)
	if errors.Is(err, pgx.ErrNoRows) {
		s.log.Info("shipment exists already", "order_id", p.orderID)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("insert shipment: %w", err)
	}
	if err := s.outbox.Add(ctx, tx, startedEvent(sh)); err != nil {
		return false, err
	}
	s.log.Info("shipment started", "order_id", p.orderID, "shipment_id", shipmentID, "deliver_at", sh.DeliverAt)
	return true, nil
}

// Shipment returns the shipment of orderID, or ErrNotFound.
func (s *Service) Shipment(ctx context.Context, orderID uuid.UUID) (Shipment, error) {
	var sh Shipment
	var items []byte
	err := s.pool.QueryRow(ctx, `
		SELECT order_id, shipment_id, state, items, started_at, deliver_at, delivered_at
		FROM shipments WHERE order_id = $1`, orderID,
	).Scan(&sh.OrderID, &sh.ShipmentID, &sh.State, &items, &sh.StartedAt, &sh.DeliverAt, &sh.DeliveredAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return Shipment{}, ErrNotFound
	}
	if err != nil {
		return Shipment{}, fmt.Errorf("read shipment %s: %w", orderID, err)
	}
	if err := json.Unmarshal(items, &sh.Items); err != nil {
		return Shipment{}, fmt.Errorf("decode items of shipment %s: %w", orderID, err)
	}
	return sh, nil
}

// deliverBatch is how many due shipments one scanner transaction delivers:
// enough to drain a backlog quickly, few enough to keep the row locks short.
const deliverBatch = 100

// deliverDue delivers up to deliverBatch due shipments in one transaction and
// returns how many it delivered. Each is marked DELIVERED and gets its
// ShipmentDelivered event in the same transaction, so a crash leaves either
// both or neither.
//
// FOR UPDATE SKIP LOCKED lets several scanners run at once: each takes rows
// the others have not locked. A row another scanner delivered and committed
// meanwhile is re-checked by Postgres against state = 'STARTED' before it is
// locked, and dropped, so each shipment is delivered exactly once.
func (s *Service) deliverDue(ctx context.Context) (int, error) {
	var events []outbox.Event
	var spans []trace.Span // one per delivery, each in its order's trace
	defer func() {
		for _, span := range spans {
			span.End()
		}
	}()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{}) // BEGIN travels with the claim: one round trip
	b.Queue(`
		WITH due AS (
			SELECT order_id FROM shipments
			WHERE state = 'STARTED' AND deliver_at <= now()
			ORDER BY deliver_at
			LIMIT $1
			FOR UPDATE SKIP LOCKED
		)
		UPDATE shipments sh SET state = 'DELIVERED', delivered_at = now()
		FROM due
		WHERE sh.order_id = due.order_id AND sh.state = 'STARTED'
		RETURNING sh.order_id, sh.shipment_id, sh.delivered_at, sh.trace_headers`, deliverBatch,
	).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var orderID, shipmentID uuid.UUID
			var at time.Time
			var started map[string]string
			if err := rows.Scan(&orderID, &shipmentID, &at, &started); err != nil {
				return fmt.Errorf("scan delivered shipment: %w", err)
			}
			ev := deliveredEvent(orderID, shipmentID, at)
			// The delivery continues the trace of the shipment's start;
			// the event carries this span, not the scanner's.
			sctx, span := s.tracer.Start(traceContext.Extract(ctx, propagation.MapCarrier(started)), "deliver shipment",
				trace.WithAttributes(attribute.String("shop.order_id", orderID.String())))
			spans = append(spans, span)
			ev.Headers = traceHeaders(sctx)
			events = append(events, ev)
		}
		return rows.Err()
	})
	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit; gives the connection back
	if err := br.Close(); err != nil {
		return 0, fmt.Errorf("claim due shipments: %w", err)
	}
	if len(events) == 0 {
		return 0, nil
	}
	if err := s.outbox.Add(ctx, tx, events...); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit deliveries: %w", err)
	}
	for _, e := range events {
		s.log.Info("shipment delivered", "order_id", e.AggregateID)
	}
	return len(events), nil
}

// traceContext is the W3C Trace Context propagator (the contract's
// traceparent).
var traceContext propagation.TraceContext

// traceHeaders is the trace context of ctx as headers, for a row that must
// carry it to a later transaction.
func traceHeaders(ctx context.Context) map[string]string {
	c := propagation.MapCarrier{}
	traceContext.Inject(ctx, c)
	return c
}
