package outbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/internal/testenv"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/outbox/migrations"
)

// The business change and its event commit in one transaction; the relay,
// running elsewhere in the process (or in another one), publishes it.
func ExampleWriter_Add() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A schema with the outbox's tables and a NATS server with an ORDERS
	// stream: the service's own, outside this example.
	pool, js, done := exampleEnv(ctx, `CREATE TABLE orders (id text PRIMARY KEY, status text)`)
	defer done()
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
		return
	}

	// The relay publishes what committed, in order, and marks it.
	relay, err := outbox.NewRelay(pool, js, outbox.Config{Name: "order-1", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		slog.Error("outbox relay", "err", err)
		return
	}
	stopped := make(chan error, 1)
	go func() { stopped <- relay.Run(ctx) }()

	// What a consumer of the ORDERS stream receives.
	cons, _ := js.OrderedConsumer(ctx, "ORDERS", jetstream.OrderedConsumerConfig{})
	msg, err := cons.Next()
	if err != nil {
		slog.Error("read the stream", "err", err)
		return
	}
	fmt.Println(msg.Subject())
	for _, h := range []string{"Event-Type", "Aggregate-Id", "Aggregate-Seq"} {
		fmt.Printf("%s: %s\n", h, msg.Headers().Get(h))
	}
	fmt.Println(string(msg.Data()))
	cancel() // the relay returns after the batch in flight
	<-stopped
	// Output:
	// orders.o-1.OrderCreated
	// Event-Type: OrderCreated
	// Aggregate-Id: o-1
	// Aggregate-Seq: 1
	// {"order_id":"o-1","total":3998}
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

// exampleEnv is the world the examples run in: a fresh schema with the
// outbox's tables (and the tables of ddl), a NATS server with an ORDERS
// stream, and done to remove them.
func exampleEnv(ctx context.Context, ddl string) (*pgxpool.Pool, jetstream.JetStream, func()) {
	db, err := testenv.Open(ctx, testenv.Migrations{Table: "outbox_goose_version", FS: migrations.FS()})
	if err != nil {
		panic(err)
	}
	if _, err := db.Pool.Exec(ctx, ddl); err != nil {
		panic(err)
	}
	dir, err := os.MkdirTemp("", "outbox-example")
	if err != nil {
		panic(err)
	}
	srv, err := testenv.StartNATS(dir)
	if err != nil {
		panic(err)
	}
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		panic(err)
	}
	js, _ := jetstream.New(nc)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		panic(err)
	}
	return db.Pool, js, func() {
		nc.Close()
		srv.Stop()
		_ = db.Close()
		_ = os.RemoveAll(dir)
	}
}
