// Package inventory is the inventory service of the shop: stock per SKU, the
// operator's restock API, and the reservations the order saga asks for.
//
// Stock lives in the inventory schema (stock, reservations,
// released_orders). Every change that others must learn about commits in one
// transaction with its outbox event:
//
//   - PUT /stock/{sku} sets on_hand and price and emits ProductUpdated, from
//     which the order service keeps its catalogue.
//   - The consumer inventory-orders reads the ORDERS stream through an inbox
//     (pkg/inbox), so each order event takes effect once, in order per
//     order: OrderCreated reserves every line or none (InventoryReserved or
//     InventoryRejected), OrderClosed and OrderRejected release
//     (InventoryReleased), OrderPaid turns the reserved units into sold ones
//     (InventoryCommitted).
//
// Overselling is prevented by row locks, not by retries: a reservation locks
// the stock rows of all its SKUs (in SKU order, so two orders never wait on
// each other in a cycle) and checks availability under the lock; the CHECK
// constraints of the stock table are the last line of defence.
//
// The outbox relay that publishes the events is not run here: the process
// (internal/app) runs one relay per schema.
package inventory

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// ConsumerName is the durable name of the consumer of order events.
const ConsumerName = "inventory-orders"

// OrdersStream is the stream the consumer reads.
const OrdersStream = "ORDERS"

// Config configures a Service.
type Config struct {
	// Logger receives the service's logs; nil discards them.
	Logger *slog.Logger
	// OperatorToken, when set, is the bearer token the operator's
	// endpoints (PUT /stock/{sku}) require (OPERATOR_TOKEN). Empty: they
	// are open to anyone who reaches the service, as in the demo.
	OperatorToken string
	// PublishHorizon is how long after an event's first publish its
	// producer's relay may still publish a copy; the inbox keeps event ids
	// longer. internal/app passes the RetryHorizon of the relays it really
	// runs. Default: the outbox relay's default RetryHorizon.
	PublishHorizon time.Duration

	// ObserveInboxFunc, when set, observes the consumer's processing times
	// (inbox.Config.ObserveFunc). Default: none.
	ObserveInboxFunc func(consumer string, d time.Duration)
	// TracerProvider makes the spans of the service's consumers (see
	// pkg/inbox) and timers. Default: nil, no spans.
	TracerProvider trace.TracerProvider

	// FailpointFunc, when set, is handed to the service's inbox consumer
	// (inbox.Config.FailpointFunc); internal/app sets it to
	// internal/failpoint.Inject. Default: none.
	FailpointFunc func(name string) error
}

// Service is the inventory service: its HTTP routes and its consumer.
type Service struct {
	pool     *pgxpool.Pool
	js       jetstream.JetStream
	log      *slog.Logger
	operator string // Config.OperatorToken
	outbox   *outbox.Writer
	consumer *inbox.Consumer
}

// New returns the service working on pool (whose search_path is the
// inventory schema) and consuming from js. It does no I/O. The pool needs at
// least 10 connections: the consumer's 8 workers, 2 for its housekeeping.
func New(pool *pgxpool.Pool, js jetstream.JetStream, cfg Config) (*Service, error) {
	if pool == nil || js == nil {
		return nil, errors.New("inventory: New needs a pool and a JetStream context")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Service{
		pool:     pool,
		js:       js,
		log:      log,
		operator: cfg.OperatorToken,
		// Under a burst of reservations one NOTIFY per 5ms is plenty: a woken
		// relay drains everything committed so far.
		outbox: &outbox.Writer{NotifyInterval: 5 * time.Millisecond},
	}
	c, err := inbox.NewConsumer(pool, js, inbox.Config{
		Name:    ConsumerName,
		Stream:  OrdersStream,
		Handler: s.handle,
		Handles: handledTypes,
		// One delivery per transaction. A reservation locks its SKUs' stock
		// rows (sorted, so two reservations never deadlock); a batch would
		// hold the rows of many orders at once, locked in no global order,
		// and under load (16 hot SKUs in make bench) batches of different
		// workers deadlocked and waited on each other: hundreds of
		// "deadlock detected" per saga run, each batch redone one delivery
		// at a time, the consumer latency-bound at 60 % CPU.
		BatchSize:       1,
		DuplicateWindow: broker.DuplicateWindow,
		// The order service's relay may publish a copy of an event this
		// long after the first; the inbox must remember ids longer.
		PublishHorizon: cmp.Or(cfg.PublishHorizon, (outbox.Config{}).RetryHorizon()),
		Logger:         log,
		ObserveFunc:    cfg.ObserveInboxFunc,
		FailpointFunc:  cfg.FailpointFunc,
		TracerProvider: cfg.TracerProvider,
	})
	if err != nil {
		return nil, fmt.Errorf("inventory: %w", err)
	}
	s.consumer = c
	return s, nil
}

// Consumers returns the service's inbox consumers, for their counters and
// lag; Run runs them.
func (s *Service) Consumers() []*inbox.Consumer { return []*inbox.Consumer{s.consumer} }

// Run consumes order events until ctx ends, then returns nil. When the
// ORDERS stream does not exist yet (the order service, which creates it, is
// another process that has not started), Run waits for it rather than fail,
// so services may start in any order.
func (s *Service) Run(ctx context.Context) error {
	// The consumer waits for its stream and JetStream by itself.
	return s.consumer.Run(ctx)
}
