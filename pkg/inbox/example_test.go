package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/inbox"
)

// The payment service opens a payment once inventory has reserved an order.
// The handler works in the inbox transaction: the effect commits together
// with the record that this event was processed.
func ExampleNewConsumer() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	pool, err := pgxpool.New(ctx, "postgres://postgres:postgres@127.0.0.1:5432/shop?search_path=payment")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Println(err)
		return
	}

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
			_, err := tx.Exec(ctx,
				`INSERT INTO payments (order_id, amount, status) VALUES ($1, $2, 'PENDING')`,
				ev.OrderID, ev.Total)
			return err // a transient error is retried with backoff
		}),
		Logger: slog.Default(),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := c.Run(ctx); err != nil { // until Ctrl-C, then drains
		fmt.Println(err)
	}
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
