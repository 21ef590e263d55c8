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
// The consumer hands its handler a batch of order events (one, when only
// one is waiting), which it decides together: one round trip locks, in SKU
// order, every stock row the batch may touch and reads the reservations and
// tombstones of its orders; the decisions are made in memory in stream
// order; one more round trip writes the stock,
// the reservations, the tombstones and the events. The hot SKUs make
// batches wait for each other, so what a batch costs is paid once for up
// to 256 orders instead of once per order.
//
// The outbox relay that publishes the events is not run here: the process
// (cmd/shop/app) runs one relay per schema.
package inventory

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// ConsumerName is the durable name of the consumer of order events.
const ConsumerName = "inventory-orders"

// OrdersStream is the stream the consumer reads.
const OrdersStream = "ORDERS"

// Config is the inventory service's own settings (its Registration
// declares their variables).
type Config struct {
	// OperatorToken, when set, is the bearer token the operator's
	// endpoints (PUT /stock/{sku}) require (OPERATOR_TOKEN). Empty: they
	// are open to anyone who reaches the service, as in the demo.
	OperatorToken string
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

// New returns the service over d (its pool's search_path is the inventory
// schema). It does no I/O. The pool needs at least the consumer's workers
// (registry.ConsumerWorkers) plus 2 for its housekeeping, and the relay's
// three beside it (Registration.PoolSize).
func New(d registry.Deps, cfg Config) (*Service, error) {
	if d.Pool == nil || d.JetStream == nil {
		return nil, errors.New("inventory: New needs a pool and a JetStream context")
	}
	s := &Service{
		pool:     d.Pool,
		js:       d.JetStream,
		log:      d.Log(),
		operator: cfg.OperatorToken,
		// Under a burst of reservations one NOTIFY per 5ms is plenty: a woken
		// relay drains everything committed so far.
		outbox: &outbox.Writer{Prefix: Prefix, NotifyInterval: 5 * time.Millisecond},
	}
	ic := d.Inbox(ordersConsumer, s.handle)
	// Those batches wait for each other on the hot stock rows, one at a
	// time: what a batch costs besides its rows (its round trips, its
	// commit) is paid once per batch, so bigger batches drain faster (row
	// 7c of make bench: 64 → 256 took the drain from about 3,600 to 6,600
	// events/s). A lone delivery still waits for nothing. Prefetch is then
	// Workers × 256 = 512 messages, an eighth of the default MaxAckPending.
	ic.BatchSize = 256
	c, err := inbox.NewConsumer(d.Pool, d.JetStream, ic)
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
