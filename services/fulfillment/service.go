// Package fulfillment is the shop's fulfillment service: a paid order becomes
// a shipment, and a (simulated) carrier delivers it after a configurable
// delay.
//
//	OrderPaid ──▶ shipment STARTED + FulfillmentStarted      (one inbox tx)
//	deliver_at ≤ now ──▶ shipment DELIVERED + ShipmentDelivered (one scanner tx)
//
// Both steps write their event through the outbox in the same transaction as
// the shipment row, so a shipment never exists without its event, nor an
// event without its shipment. The delivery timer is the deliver_at column,
// not an in-process timer: it survives restarts, and any number of instances
// may scan it side by side because each claims due rows with SKIP LOCKED.
package fulfillment

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// ConsumerName is the durable consumer on ORDERS (docs/events.md).
const ConsumerName = "fulfillment-orders"

// Service is the fulfillment service: its HTTP routes, its ORDERS consumer
// and its delivery scanner. It is safe for concurrent use; several instances
// (in one process or many) may share one schema.
type Service struct {
	pool     *pgxpool.Pool
	cfg      Config
	log      *slog.Logger
	outbox   *outbox.Writer
	consumer *inbox.Consumer
	tracer   trace.Tracer // the deliveries' spans
}

// New checks cfg and returns a Service over d (its pool's search_path is
// the fulfillment schema); it does no I/O. The pool needs room for the
// consumer's workers plus two (see inbox.Config.Workers) and one more for
// the scanner.
func New(d registry.Deps, cfg Config) (*Service, error) {
	if d.Pool == nil || d.JetStream == nil {
		return nil, errors.New("fulfillment: New needs a pool and a JetStream context")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	tp := d.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	s := &Service{
		tracer: tp.Tracer("github.com/shop-ref/shop/services/fulfillment"),
		pool:   d.Pool,
		cfg:    cfg,
		log:    d.Log(),
		// Coalesced NOTIFYs: one wake-up per 5ms is enough for the relay,
		// which drains everything committed so far when it wakes.
		outbox: &outbox.Writer{Prefix: Prefix, NotifyInterval: 5 * time.Millisecond},
	}
	c, err := inbox.NewConsumer(d.Pool, d.JetStream, d.Inbox(ordersConsumer, inbox.Each(s.handle)))
	if err != nil {
		return nil, err
	}
	s.consumer = c
	return s, nil
}

// Consumers returns the service's inbox consumers, for their counters and
// lag; Run runs them.
func (s *Service) Consumers() []*inbox.Consumer { return []*inbox.Consumer{s.consumer} }

// Run consumes ORDERS and delivers due shipments until ctx ends, then returns
// nil. It returns an error only when the consumer cannot run (no stream, a
// refused configuration); a database outage is logged and retried by both
// parts, never fatal.
func (s *Service) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return s.consumer.Run(ctx) })
	g.Go(func() error { s.runDeliveries(ctx); return nil })
	return g.Wait()
}
