package saga_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/saga"
)

// A two-step saga: a parcel waits for a pickup, which must happen within an
// hour, or the parcel is returned.
func ExampleNew() {
	events := outbox.Writer{Prefix: "parcels"} // subjects parcels.<id>.<Type>
	parcel, err := saga.New("parcel",
		saga.Transition{From: "WAITING", Event: "PickedUp", To: "IN_TRANSIT",
			Func: func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
				st.CancelTimeout("pickup")
				// Queued on the step's batch: sent with the new state, in
				// one round trip, and committed with it.
				return events.Queue(ctx, st.Batch(), outbox.Event{
					AggregateType: "parcel", AggregateID: st.Instance.ID, Type: "ParcelInTransit",
					Payload: map[string]string{"parcel_id": st.Instance.ID},
				})
			}},
		saga.Transition{From: "WAITING", Event: saga.TimeoutEvent("pickup"), To: "RETURNED"},
	)
	if err != nil {
		panic(err)
	}
	_ = parcel                               // Start, Apply and NewScanner take it
	fmt.Println(saga.TimeoutEvent("pickup")) // the event a fired pickup timeout applies
	// Output: timeout:pickup
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
