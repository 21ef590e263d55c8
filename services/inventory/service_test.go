package inventory

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

// fixture is one test's service on its own schema and NATS server.
type fixture struct {
	db   *pgtest.Schema
	svc  *Service
	pool *pgxpool.Pool
	js   jetstream.JetStream
	http *httptest.Server
}

// setup starts a service on a fresh inventory schema and a fresh NATS server
// with the ORDERS and INVENTORY streams. The consumer is not running; see
// runConsumer.
func setup(t *testing.T) *fixture {
	t.Helper()
	return setupWith(t, nil)
}

// setupWith is setup with the service logging to log (nil: nowhere).
func setupWith(t *testing.T, log *slog.Logger) *fixture {
	t.Helper()
	db := pgtest.New(t, Registration.Sets()...)
	ns := natstest.New(t)
	_, js := ns.Connect(t)
	ns.Stream(t, js, "ORDERS", "orders.>")
	ns.Stream(t, js, "INVENTORY", "inventory.>")
	svc, err := New(registry.Deps{Pool: db.Pool, JetStream: js, Logger: log}, Config{})
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	svc.Routes(r)
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	return &fixture{db: db, svc: svc, pool: db.Pool, js: js, http: srv}
}

// runConsumer runs the service's consumer until the test ends and checks
// that Run then returns nil.
func (f *fixture) runConsumer(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.svc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("Run did not return after its context ended")
		}
	})
}

// publish sends an order event to ORDERS as the order service's relay would,
// with the contract's headers, and returns its event id.
func (f *fixture) publish(t *testing.T, orderID string, seq int64, typ string, payload any) string {
	t.Helper()
	data, err := json.Marshal(payload)
	if err != nil {
		t.Fatal(err)
	}
	id := uuid.NewString()
	f.publishRaw(t, id, orderID, seq, typ, data)
	return id
}

func (f *fixture) publishRaw(t *testing.T, eventID, orderID string, seq int64, typ string, data []byte) {
	t.Helper()
	natstest.Publish(t, f.js, natstest.Event{
		ID: uuid.MustParse(eventID), Prefix: "orders", AggregateType: "order", AggregateID: orderID,
		Type: typ, Seq: seq, Payload: data,
	}.Msg(t))
}

// apply hands m to the consumer's handler alone, a batch of one, as the
// inbox does with a lone delivery (applyBatch).
func (f *fixture) apply(t *testing.T, m inbox.Message) error {
	t.Helper()
	return f.applyBatch(t, []inbox.Message{m})
}

// message is an order event as the inbox hands it to the handler.
func message(t *testing.T, orderID string, seq int64, typ string, payload any) inbox.Message {
	t.Helper()
	data, err := json.Marshal(payload)
	if err != nil {
		t.Fatal(err)
	}
	return inbox.Message{
		EventID: uuid.New(), Type: typ, AggregateType: "order", AggregateID: orderID,
		Seq: seq, SchemaVersion: 1, OccurredAt: time.Now(),
		Subject: "orders." + orderID + "." + typ, Data: data,
	}
}

// stockRow is a stock row with the column the API does not show.
type stockRow struct {
	Stock
	Supplied int64
}

func (f *fixture) stock(t *testing.T, sku string) stockRow {
	t.Helper()
	var s stockRow
	err := f.pool.QueryRow(context.Background(),
		`SELECT `+stockColumns+`, supplied FROM stock WHERE sku = $1`, sku).
		Scan(&s.SKU, &s.OnHand, &s.Reserved, &s.Available, &s.Sold, &s.Price, &s.Supplied)
	if err != nil {
		t.Fatalf("read stock %s: %v", sku, err)
	}
	return s
}

// seed sets stock directly, with its ProductUpdated event, as PUT would.
func (f *fixture) seed(t *testing.T, sku string, onHand, price int64) {
	t.Helper()
	ctx := context.Background()
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	st, err := setStock(ctx, tx, sku, onHand, price)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.svc.outbox.Add(ctx, tx, productEvent(st)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// outboxEvent is one row of the service's outbox.
type outboxEvent struct {
	Type    string
	Payload string
}

// events returns the outbox rows of one aggregate in sequence order.
func (f *fixture) events(t *testing.T, aggregateID string) []outboxEvent {
	t.Helper()
	var out []outboxEvent
	for _, rec := range outboxtest.Written(t, f.pool, outboxtest.Want{AggregateID: aggregateID}) {
		out = append(out, outboxEvent{Type: rec.Type, Payload: string(rec.Payload)})
	}
	return out
}

// count runs a count query.
func (f *fixture) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := f.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// decode unmarshals a payload for comparison.
func decode[T any](t *testing.T, payload string) T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(payload), &v); err != nil {
		t.Fatalf("decode %s: %v", payload, err)
	}
	return v
}

func TestNew(t *testing.T) {
	t.Parallel()
	if _, err := New(registry.Deps{}, Config{}); err == nil {
		t.Fatal("New without a pool and JetStream: want an error")
	}
}

func TestRunWaitsForStreamAndStops(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, Registration.Sets()...)
	ns := natstest.New(t)
	_, js := ns.Connect(t)
	svc, err := New(registry.Deps{Pool: db.Pool, JetStream: js}, Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()

	// No ORDERS stream yet: Run waits instead of failing.
	select {
	case err := <-done:
		t.Fatalf("Run returned before its context ended: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	ns.Stream(t, js, "ORDERS", "orders.>")
	poll.Until(t, 15*time.Second, "the durable consumer", func() bool {
		_, err := js.Consumer(context.Background(), "ORDERS", ConsumerName)
		return err == nil
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}
