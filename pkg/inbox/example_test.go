package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/migrations"
	"github.com/shop-ref/shop/pkg/internal/testenv"
)

// A consumer of the INVENTORY stream opens a payment once inventory has
// reserved an order (a simplified flow: the shop's payment service opens
// its intent from OrderCreated, docs/events.md). The handler works in the inbox transaction: the effect commits together
// with the record that this event was processed, so a second copy of the
// event (a relay that died before marking it published sends it again) has
// no effect.
func ExampleNewConsumer() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A schema with the inbox's tables and a NATS server with an INVENTORY
	// stream: the service's own, outside this example.
	pool, js, done := exampleEnv(ctx, `CREATE TABLE payments (order_id text PRIMARY KEY, amount bigint, status text)`)
	defer done()

	c, err := inbox.NewConsumer(pool, js, inbox.Config{
		Name:   "payment",
		Stream: "INVENTORY",
		// Every event of the stream passes the sequence check; only these
		// types reach Handler, the others are only recorded, in no
		// transaction of their own.
		Handles: []string{"InventoryReserved"},
		// One event at a time; a batch is handed over whole to a handler
		// that needs no [inbox.Each].
		Handler: inbox.Each(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
			var ev struct {
				OrderID string `json:"order_id"`
				Total   int64  `json:"total"`
			}
			if err := json.Unmarshal(m.Data, &ev); err != nil {
				return inbox.Poison(err) // retrying will not make it parse
			}
			fmt.Println("open a payment of", ev.Total, "for", ev.OrderID)
			_, err := tx.Exec(ctx,
				`INSERT INTO payments (order_id, amount, status) VALUES ($1, $2, 'PENDING')`,
				ev.OrderID, ev.Total)
			return err // a transient error is retried with backoff
		}),
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(ctx) }() // until ctx ends, then drains

	reserved := inventoryEvent(1, "InventoryReserved", `{"order_id":"o-1","total":3998}`)
	publish(ctx, js, reserved)
	publish(ctx, js, inventoryEvent(2, "InventoryReleased", `{"order_id":"o-1"}`))
	time.Sleep(150 * time.Millisecond) // past the stream's duplicate window: the broker keeps the copy
	publish(ctx, js, reserved)

	for got := c.Counters(); got.Processed+got.Duplicates < 3; got = c.Counters() {
		time.Sleep(10 * time.Millisecond)
	}
	var payments int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&payments)
	fmt.Printf("%d payment; processed %d, duplicates %d\n", payments, c.Counters().Processed, c.Counters().Duplicates)
	cancel()
	<-stopped
	// Output:
	// open a payment of 3998 for o-1
	// 1 payment; processed 2, duplicates 1
}

// An operator looks at what failed and, after fixing the cause, sends it
// through the consumer again.
func ExampleRequeueDeadLetter() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres:postgres@127.0.0.1:5432/shop?search_path=payment")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	dead, err := inbox.ListDeadLetters(ctx, pool, "payment", 20)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, dl := range dead {
		fmt.Printf("%d %s %s after %d attempts: %s\n", dl.ID, dl.Subject, dl.EventID, dl.Attempts, dl.Error)
		if err := inbox.RequeueDeadLetter(ctx, pool, dl.ID); err != nil {
			fmt.Println(err)
		}
	}
}

// A handler tells a hopeless message from a passing failure: Poison sends it
// to the dead letters at once, any other error is retried with backoff.
func ExamplePoison() {
	err := inbox.Poison(fmt.Errorf("OrderCreated schema version %d: this service reads version 1", 3))
	fmt.Println(errors.Is(err, inbox.ErrPoison))
	fmt.Println(err)
	// Output:
	// true
	// poison: OrderCreated schema version 3: this service reads version 1
}

// exampleEnv is the world the examples run in: a fresh schema with the
// inbox's tables (and the tables of ddl), a NATS server with an INVENTORY
// stream whose duplicate window is short, and done to remove them.
func exampleEnv(ctx context.Context, ddl string) (*pgxpool.Pool, jetstream.JetStream, func()) {
	db, err := testenv.Open(ctx, testenv.Migrations{Table: "inbox_goose_version", FS: migrations.FS()})
	if err != nil {
		panic(err)
	}
	if _, err := db.Pool.Exec(ctx, ddl); err != nil {
		panic(err)
	}
	dir, err := os.MkdirTemp("", "inbox-example")
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
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "INVENTORY", Subjects: []string{"inventory.>"}, Duplicates: 100 * time.Millisecond,
	}); err != nil {
		panic(err)
	}
	return db.Pool, js, func() {
		nc.Close()
		srv.Stop()
		_ = db.Close()
		_ = os.RemoveAll(dir)
	}
}

var exampleIDs = map[int64]uuid.UUID{}

// inventoryEvent is the message the inventory service's outbox relay
// publishes for the seq-th event of order o-1: the headers are the
// contract between pkg/outbox and pkg/inbox.
func inventoryEvent(seq int64, typ, payload string) *nats.Msg {
	if _, ok := exampleIDs[seq]; !ok {
		exampleIDs[seq] = uuid.New()
	}
	m := nats.NewMsg("inventory.o-1." + typ)
	m.Header.Set(jetstream.MsgIDHeader, exampleIDs[seq].String())
	m.Header.Set("Event-Type", typ)
	m.Header.Set("Aggregate-Type", "order")
	m.Header.Set("Aggregate-Id", "o-1")
	m.Header.Set("Aggregate-Seq", strconv.FormatInt(seq, 10))
	m.Header.Set("Schema-Version", "1")
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339Nano))
	m.Data = []byte(payload)
	return m
}

func publish(ctx context.Context, js jetstream.JetStream, m *nats.Msg) {
	if _, err := js.PublishMsg(ctx, m); err != nil {
		panic(err)
	}
}
