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
	"cmp"
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/broker"
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

// New checks cfg and returns a Service; it does no I/O. The pool needs room
// for the consumer's workers plus two (see inbox.Config.Workers) and one more
// for the scanner.
func New(pool *pgxpool.Pool, js jetstream.JetStream, cfg Config) (*Service, error) {
	if pool == nil || js == nil {
		return nil, errors.New("fulfillment: New needs a pool and a JetStream context")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Service{
		tracer: cfg.TracerProvider.Tracer("github.com/shop-ref/shop/services/fulfillment"),
		pool:   pool,
		cfg:    cfg,
		log:    cfg.Logger,
		// Coalesced NOTIFYs: one wake-up per 5ms is enough for the relay,
		// which drains everything committed so far when it wakes.
		outbox: &outbox.Writer{NotifyInterval: 5 * time.Millisecond},
	}
	c, err := inbox.NewConsumer(pool, js, inbox.Config{
		Name:    ConsumerName,
		Stream:  "ORDERS",
		Handler: s.handle,
		// Fulfillment needs one event per order, OrderPaid, and nothing
		// it does depends on the order of events: JetStream delivers only
		// OrderPaid, and the per-aggregate sequence check, which would
		// need every event of the order, is off. processed_events still
		// absorbs every copy, and the shipment is keyed by order besides.
		FilterSubjects:    []string{"orders.*." + typeOrderPaid},
		SkipSequenceCheck: true,
		DuplicateWindow:   broker.DuplicateWindow,
		// The order service's relay may publish a copy of an event for this
		// long; the inbox must remember event ids for longer.
		PublishHorizon: cmp.Or(cfg.PublishHorizon, (outbox.Config{}).RetryHorizon()),
		Logger:         cfg.Logger,
		ObserveFunc:    cfg.ObserveInboxFunc,
		FailpointFunc:  cfg.FailpointFunc,
		TracerProvider: cfg.TracerProvider,
	})
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
