// Package order is the order service: it takes orders over HTTP with
// idempotency keys, keeps its own copy of the catalogue, and coordinates
// each order's saga (pkg/saga) across inventory, payment and fulfillment.
//
// Every write that emits an event does so through the service's outbox in
// the same transaction: a new order with OrderCreated, each saga transition
// with the events it causes.
//
// Choices the contract leaves open:
//
//   - The Idempotency-Key request hash is SHA-256 of the decoded request
//     encoded again as JSON (fields in struct order, lines in request order),
//     so the same request spelled differently is the same request.
//   - A replay returns the response stored with the key (201 and the order as
//     it was created, in the very bytes first sent), not the order's current
//     state, as payment APIs do; it does so even while new orders are shed.
//   - A SKU listed on two lines is refused with 422 rather than merged.
//   - Keys must be 1..255 printable ASCII characters (400 otherwise).
//   - The customer's cancel is the saga event "CustomerCancel"; a refund is
//     requested once per payment_id (remembered in the saga's data), and the
//     payment that paid the order is never refunded by a late copy of itself.
package order

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/saga"
)

// Config is the order service's own settings (its Entry declares their
// variables). Zero fields take their defaults.
type Config struct {
	// PaymentTimeout (PAYMENT_TIMEOUT) is how long an order may wait in
	// WAIT_PAY: its pay_by is this long after it enters WAIT_PAY, and
	// payment expires the intent then; default DefaultPaymentTimeout.
	PaymentTimeout time.Duration
	// PaymentOverdue is how long after pay_by an order payment has neither
	// paid nor expired asks payment again (OrderPaymentOverdue); default
	// PaymentTimeout, and a minute at least.
	PaymentOverdue time.Duration
	// ReservationTimeout (ORDER_RESERVATION_TIMEOUT) is how long an order
	// may stay PENDING, waiting for inventory to reserve it and payment to
	// open its intent, before the saga closes it; default
	// DefaultReservationTimeout.
	ReservationTimeout time.Duration
	// FulfillmentTimeout (ORDER_FULFILLMENT_TIMEOUT) is how long a paid
	// order may wait for its shipment to be delivered (PAID and
	// FULFILLING) before the saga closes it and refunds its payment;
	// default DefaultFulfillmentTimeout.
	FulfillmentTimeout time.Duration
	// KeyTTL (IDEMPOTENCY_KEY_TTL) is how long an Idempotency-Key is
	// remembered; default DefaultKeyTTL.
	KeyTTL time.Duration
	// MaxBacklog (ORDER_MAX_BACKLOG) is how many events the saga's
	// consumers may have left to settle before POST /orders answers 503
	// (see admission); default DefaultMaxBacklog, negative: never shed.
	MaxBacklog int64
}

func (c *Config) setDefaults() {
	c.PaymentTimeout = cmp.Or(c.PaymentTimeout, DefaultPaymentTimeout)
	c.PaymentOverdue = cmp.Or(c.PaymentOverdue, max(c.PaymentTimeout, time.Minute))
	c.ReservationTimeout = cmp.Or(c.ReservationTimeout, DefaultReservationTimeout)
	c.FulfillmentTimeout = cmp.Or(c.FulfillmentTimeout, DefaultFulfillmentTimeout)
	c.KeyTTL = cmp.Or(c.KeyTTL, DefaultKeyTTL)
	c.MaxBacklog = cmp.Or(c.MaxBacklog, DefaultMaxBacklog)
}

func (c *Config) validate() error {
	if c.PaymentTimeout < 0 || c.PaymentOverdue < 0 || c.ReservationTimeout < 0 || c.FulfillmentTimeout < 0 || c.KeyTTL < 0 {
		return fmt.Errorf("order: PaymentTimeout (%s), PaymentOverdue (%s), ReservationTimeout (%s), FulfillmentTimeout (%s) and KeyTTL (%s) must not be negative",
			c.PaymentTimeout, c.PaymentOverdue, c.ReservationTimeout, c.FulfillmentTimeout, c.KeyTTL)
	}
	return nil
}

// DefaultPaymentTimeout is the contract's PAYMENT_TIMEOUT default.
const DefaultPaymentTimeout = 15 * time.Minute

// DefaultFulfillmentTimeout is Config.FulfillmentTimeout's default. The
// demo's carrier delivers FULFILLMENT_DELAY (2s) after the shipment
// starts; a day without a delivery means fulfillment, its consumer or the
// broker has been gone for long, and the customer gets the money back
// rather than an order that never ends.
const DefaultFulfillmentTimeout = 24 * time.Hour

// DefaultKeyTTL is IDEMPOTENCY_KEY_TTL's default: a day covers any
// client's retries.
const DefaultKeyTTL = 24 * time.Hour

// DefaultReservationTimeout is Config.ReservationTimeout's default.
// Inventory and payment answer an OrderCreated in milliseconds; minutes
// without an answer mean one of them, its consumer or the broker is down. Five minutes rides
// out a restart, a NATS failover or a short outage (the outbox and the
// stream keep the events) without closing orders that would have been
// reserved, and does not leave a customer waiting indefinitely: after it,
// the order is CLOSED (reservation_timeout) and whatever inventory
// reserves later is released again.
const DefaultReservationTimeout = 5 * time.Minute

// DefaultMaxBacklog is Config.MaxBacklog's default. Each order puts about
// three events at a time before the saga's consumers (OrderCreated reaches
// inventory, payment and fulfillment), so this is a few hundred orders in
// flight: a few seconds of work for the demo shop on two cores.
const DefaultMaxBacklog = 1000

// consumerWorkers is the Workers of each of the three consumers. Each needs
// Workers+2 pool connections, so the service's pool wants about
// 3×(consumerWorkers+2) + a few for HTTP and the scanner.
const consumerWorkers = registry.ConsumerWorkers

// PoolSize is the least pool size Run needs, with room for HTTP requests
// and the timeout scanner (HTTP waits for a connection rather than failing
// when they are busy).
const PoolSize = 3*(consumerWorkers+2) + 4

// Service is the order service.
type Service struct {
	pool  *pgxpool.Pool
	js    jetstream.JetStream
	cfg   Config
	log   *slog.Logger
	hooks registry.Hooks

	outbox    outbox.Writer
	saga      *saga.Saga
	consumers []*inbox.Consumer
	scanner   *saga.Scanner
	admission *admission

	scanEvery    time.Duration // how often the saga scanner looks for due timeouts
	cleanupEvery time.Duration // how often expired idempotency keys are deleted
}

// New returns the service over d (its pool's search_path is the order
// schema); it does no I/O.
func New(d registry.Deps, cfg Config) (*Service, error) {
	if d.Pool == nil || d.JetStream == nil {
		return nil, errors.New("order: New needs a pool and a JetStream context")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Service{
		pool:  d.Pool,
		js:    d.JetStream,
		cfg:   cfg,
		log:   d.Log(),
		hooks: d.Hooks,
		// NOTIFY takes a database-wide lock at commit; one wake-up per 5ms
		// is plenty for the relay, polling covers the rest.
		outbox:       outbox.Writer{Prefix: Prefix, NotifyInterval: 5 * time.Millisecond},
		scanEvery:    cmp.Or(min(cfg.PaymentTimeout/4, cfg.ReservationTimeout/4, cfg.FulfillmentTimeout/4, time.Second), time.Millisecond),
		cleanupEvery: max(min(cfg.KeyTTL/2, time.Hour), time.Second),
	}
	s.admission = &admission{js: s.js, limit: cfg.MaxBacklog, every: 200 * time.Millisecond, log: s.log,
		consumers: sagaConsumers(d.Readers)}
	var err error
	if s.saga, err = s.newSaga(); err != nil {
		return nil, err
	}
	outcomes := map[string][]string{
		"order-inventory":   inventoryOutcomes,
		"order-payment":     paymentOutcomes,
		"order-fulfillment": fulfillmentOutcomes,
	}
	for _, c := range consumers {
		cfg := d.Inbox(c, s.handler(outcomes[c.Name]))
		cfg.Workers = consumerWorkers
		consumer, err := inbox.NewConsumer(s.pool, s.js, cfg)
		if err != nil {
			return nil, fmt.Errorf("order: %w", err)
		}
		s.consumers = append(s.consumers, consumer)
	}
	s.scanner, err = saga.NewScanner(s.pool, saga.ScannerConfig{PollInterval: s.scanEvery, Logger: s.log,
		Hooks: saga.Hooks{FailpointFunc: d.Hooks.FailpointFunc}, TracerProvider: d.TracerProvider}, s.saga)
	if err != nil {
		return nil, fmt.Errorf("order: %w", err)
	}
	return s, nil
}

// Consumers returns the service's inbox consumers, for their counters and
// lag; Run runs them.
func (s *Service) Consumers() []*inbox.Consumer { return s.consumers }

// TimeoutsFired returns how many saga timeouts (reservation, payment
// safety net, fulfillment) this instance has fired.
func (s *Service) TimeoutsFired() int64 { return s.scanner.Fired() }

// Run consumes the INVENTORY, PAYMENT and FULFILLMENT streams, fires
// the saga's timeouts, deletes expired idempotency keys and watches the saga's backlog
// for admission until ctx ends; it then
// returns nil. It returns an error when a part cannot start or fails.
func (s *Service) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, c := range s.consumers {
		g.Go(func() error {
			// A consumer waits for its stream and JetStream by itself.
			if err := c.Run(ctx); err != nil {
				return fmt.Errorf("order: consumer %s: %w", c.Name(), err)
			}
			return nil
		})
	}
	g.Go(func() error { return s.scanner.Run(ctx) })
	g.Go(func() error { s.cleanKeys(ctx); return nil })
	g.Go(func() error { s.admission.run(ctx); return nil })
	return g.Wait()
}

// cleanKeys deletes expired idempotency keys now and then. Expired keys are
// already ignored by POST /orders; deleting them only keeps the table small.
func (s *Service) cleanKeys(ctx context.Context) {
	for {
		n, err := deleteExpiredKeys(ctx, s.pool)
		switch {
		case err != nil && ctx.Err() == nil:
			s.log.Error("idempotency key cleanup failed", "err", err)
		case n > 0:
			s.log.Info("idempotency keys expired", "deleted", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(s.cleanupEvery):
		}
	}
}
