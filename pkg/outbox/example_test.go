package outbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/outbox"
)

// The business change and its event commit in one transaction; the relay,
// running elsewhere in the process (or in another one), publishes it.
func ExampleWriter_Add() {
	ctx := context.Background()
	var pool *pgxpool.Pool // connected with search_path = the service's schema
	// The writer owns the subject rule: orders.<aggregate id>.<type>.
	events := outbox.Writer{Prefix: "orders"}

	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, status) VALUES ($1, 'PENDING')`, "o-1"); err != nil {
			return err
		}
		return events.Add(ctx, tx, outbox.Event{
			AggregateType: "order",
			AggregateID:   "o-1",
			Type:          "OrderCreated",
			Payload:       map[string]any{"order_id": "o-1", "total": 3998},
		})
	})
	if err != nil {
		slog.Error("create order", "err", err)
	}
}

func ExampleRelay_Run() {
	ctx := context.Background()
	var pool *pgxpool.Pool
	var js jetstream.JetStream

	relay, err := outbox.NewRelay(pool, js, outbox.Config{Name: "order-1"})
	if err != nil {
		slog.Error("outbox relay", "err", err)
		return
	}
	_ = relay.Run(ctx) // returns when ctx ends, after the batch in flight
}

// How long may copies of one event keep coming? Every attempt may wait out
// a lease, a publish timeout and a full backoff. pkg/inbox must remember
// event ids for longer than this.
func ExampleConfig_RetryHorizon() {
	cfg := outbox.Config{MaxAttempts: 10, LeaseDuration: 30 * time.Second, PublishTimeout: 10 * time.Second, BackoffMax: time.Minute}
	fmt.Println(cfg.RetryHorizon())
	// Output: 16m40s
}
