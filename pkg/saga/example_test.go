package saga_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/pkg/internal/testenv"
	"github.com/shop-ref/shop/pkg/saga"
	"github.com/shop-ref/shop/pkg/saga/migrations"
)

// A two-step saga: a parcel waits for a pickup, which must happen within an
// hour, or the parcel is returned. Events drive it (Apply, in the caller's
// transaction), and so do its durable timeouts (a Scanner fires them).
func ExampleNew() {
	ctx := context.Background()
	pool, done := exampleDB(ctx, `CREATE TABLE parcel_log (parcel text, entry text)`)
	defer done()

	parcel, err := saga.New("parcel",
		saga.Transition{From: "WAITING", Event: "PickedUp", To: "IN_TRANSIT",
			Func: func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
				st.CancelTimeout("pickup")
				// Queued on the step's batch: sent with the new state, in
				// one round trip, and committed with it. An outbox event
				// goes the same way (outbox.Writer.Queue).
				st.Batch().Queue(`INSERT INTO parcel_log VALUES ($1, 'in transit')`, st.Instance.ID)
				return nil
			}},
		saga.Transition{From: "WAITING", Event: saga.TimeoutEvent("pickup"), To: "RETURNED"},
	)
	if err != nil {
		panic(err)
	}
	inTx := func(f func(tx pgx.Tx) error) {
		if err := pgx.BeginFunc(ctx, pool, f); err != nil {
			panic(err)
		}
	}

	// p-1 has an hour to be picked up; p-2's hour is over already.
	for id, due := range map[string]time.Time{"p-1": time.Now().Add(time.Hour), "p-2": time.Now().Add(-time.Second)} {
		inTx(func(tx pgx.Tx) error {
			return parcel.Start(ctx, tx, id, "WAITING", nil, saga.Timeout{Name: "pickup", Due: due})
		})
	}

	// An event moves p-1, in the caller's transaction (an inbox handler's).
	inTx(func(tx pgx.Tx) error {
		res, err := parcel.Apply(ctx, tx, "p-1", saga.Event{Type: "PickedUp", ID: "ev-1"})
		fmt.Println("p-1:", res.From, "->", res.To)
		return err
	})

	// A scanner fires p-2's due pickup timeout.
	sc, err := saga.NewScanner(pool, saga.ScannerConfig{PollInterval: 10 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)}, parcel)
	if err != nil {
		panic(err)
	}
	scanning, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- sc.Run(scanning) }()
	for sc.Fired() == 0 {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	<-stopped
	p2, _ := saga.Load(ctx, pool, "p-2")
	fmt.Println("p-2:", p2.State)

	// Too late for p-2: an event the state does not expect is recorded
	// and changes nothing.
	inTx(func(tx pgx.Tx) error {
		res, err := parcel.Apply(ctx, tx, "p-2", saga.Event{Type: "PickedUp", ID: "ev-2"})
		fmt.Println("p-2: applied", res.Applied, "in", res.From)
		return err
	})
	// Output:
	// p-1: WAITING -> IN_TRANSIT
	// p-2: RETURNED
	// p-2: applied false in RETURNED
}

// Apply runs inside an inbox handler's transaction, so the transition
// commits with the processed_events row.
func ExampleSaga_Apply() {
	var parcel *saga.Saga // from saga.New
	handler := func(ctx context.Context, tx pgx.Tx, parcelID string) error {
		res, err := parcel.Apply(ctx, tx, parcelID, saga.Event{Type: "PickedUp"})
		if err != nil {
			return err // the inbox rolls back and retries
		}
		if !res.Applied {
			fmt.Println("unexpected in", res.From) // recorded in saga_unexpected, acked
		}
		return nil
	}
	_ = handler
}

// The business row that starts a saga, the instance and the pickup deadline
// of its first state go in one batch: one round trip, one transaction.
func ExampleSaga_QueueStart() {
	ctx := context.Background()
	var pool *pgxpool.Pool
	var parcel *saga.Saga // from saga.New
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO parcels (id) VALUES ($1)`, "p-1")
		pickup := saga.Timeout{Name: "pickup", Due: time.Now().Add(time.Hour)}
		if err := parcel.QueueStart(ctx, b, "p-1", "WAITING", nil, pickup); err != nil {
			return err
		}
		return tx.SendBatch(ctx, b).Close() // errors.Is(err, saga.ErrExists) for a taken id
	})
	_ = err
}

// A Scanner fires timeouts; run one or several per schema.
func ExampleScanner_Run() {
	var pool *pgxpool.Pool // the service's pool
	var parcel *saga.Saga
	sc, err := saga.NewScanner(pool, saga.ScannerConfig{PollInterval: time.Second}, parcel)
	if err != nil {
		return
	}
	_ = sc.Run // go sc.Run(ctx): returns nil when ctx ends
}

// exampleDB is a fresh schema with the saga's tables and those of ddl, and
// done to drop it: the service's own database, outside the examples.
func exampleDB(ctx context.Context, ddl string) (*pgxpool.Pool, func()) {
	db, err := testenv.Open(ctx, testenv.Migrations{Table: "saga_goose_version", FS: migrations.FS()})
	if err != nil {
		panic(err)
	}
	if _, err := db.Pool.Exec(ctx, ddl); err != nil {
		panic(err)
	}
	return db.Pool, func() { _ = db.Close() }
}
