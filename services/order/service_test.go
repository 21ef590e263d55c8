package order

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/pkg/saga"
	"github.com/shop-ref/shop/pkg/saga/sagatest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services/fulfillment"
	"github.com/shop-ref/shop/services/inventory"
	paymentsvc "github.com/shop-ref/shop/services/payment"
)

// env is one test's world: its own schema, NATS server with the four
// streams, a running Service and its HTTP server.
type env struct {
	svc  *Service
	db   *pgtest.Schema
	pool *pgxpool.Pool
	js   jetstream.JetStream
	url  string

	mu   sync.Mutex
	seqs map[string]int64 // next Aggregate-Seq per producer and aggregate
}

func setup(t *testing.T, cfg Config) *env {
	t.Helper()
	return setupWith(t, cfg, registry.Hooks{})
}

// shopReaders are the shop's consumers, as services.All declares them (a
// package that this package's tests cannot import: it imports this one).
func shopReaders() []registry.Reader {
	return registry.Registry{inventory.Registration, Registration, paymentsvc.Registration, fulfillment.Registration}.Readers()
}

// setupWith is setup with hooks (failpoints).
func setupWith(t *testing.T, cfg Config, hooks registry.Hooks) *env {
	t.Helper()
	db := pgtest.New(t, Registration.Sets()...)
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	for name, subj := range map[string]string{"ORDERS": "orders.>", "INVENTORY": "inventory.>", "PAYMENT": "payment.>", "FULFILLMENT": "fulfillment.>"} {
		srv.Stream(t, js, name, subj)
	}
	pool := db.NewPool(t, PoolSize)
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	svc, err := New(registry.Deps{Pool: pool, JetStream: js, Logger: log, Readers: shopReaders(), Hooks: hooks}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	svc.Routes(r)
	hs := httptest.NewServer(r)
	t.Cleanup(hs.Close)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
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
	return &env{svc: svc, db: db, pool: pool, js: js, url: hs.URL, seqs: map[string]int64{}}
}

// upstream builds an event as a producer's outbox relay would publish it,
// with the contract's headers and the producer's next sequence number.
func (e *env) upstream(prefix, aggType, aggID, typ string, payload any) *nats.Msg {
	e.mu.Lock()
	k := prefix + "/" + aggType + "/" + aggID
	e.seqs[k]++
	seq := e.seqs[k]
	e.mu.Unlock()
	m := nats.NewMsg(prefix + "." + aggID + "." + typ)
	m.Header.Set(jetstream.MsgIDHeader, uuid.NewString())
	m.Header.Set("Event-Type", typ)
	m.Header.Set("Aggregate-Type", aggType)
	m.Header.Set("Aggregate-Id", aggID)
	m.Header.Set("Aggregate-Seq", strconv.FormatInt(seq, 10))
	m.Header.Set("Schema-Version", "1")
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339Nano))
	m.Data, _ = json.Marshal(payload)
	return m
}

func (e *env) send(t *testing.T, m *nats.Msg) {
	t.Helper()
	natstest.Publish(t, e.js, m)
}

// publish sends an upstream event about order id.
func (e *env) publish(t *testing.T, prefix string, id uuid.UUID, typ string, payload any) *nats.Msg {
	t.Helper()
	m := e.upstream(prefix, "order", id.String(), typ, payload)
	e.send(t, m)
	return m
}

// payable publishes both answers to order id's OrderCreated, in the order
// given: inventory's reservation and payment's open intent, which together
// move the order to WAIT_PAY. It returns the intent's id.
func (e *env) payable(t *testing.T, id uuid.UUID, intentFirst bool) uuid.UUID {
	t.Helper()
	intent := uuid.New()
	reserve := func() {
		e.publish(t, "inventory", id, "InventoryReserved", map[string]any{"order_id": id, "items": []any{}})
	}
	open := func() {
		e.publish(t, "payment", id, "PaymentOpened", map[string]any{"order_id": id, "intent_id": intent, "amount": 0})
	}
	if intentFirst {
		open()
		reserve()
	} else {
		reserve()
		open()
	}
	return intent
}

// stock publishes ProductUpdated and waits until the catalogue has it.
func (e *env) stock(t *testing.T, sku string, price int64) {
	t.Helper()
	e.send(t, e.upstream("inventory", "product", sku, "ProductUpdated",
		map[string]any{"sku": sku, "price": price, "on_hand": 10, "reserved": 0, "available": 10}))
	poll.Until(t, 15*time.Second, "catalogue to learn "+sku, func() bool {
		return e.count(t, `SELECT count(*) FROM catalogue WHERE sku = $1 AND price = $2`, sku, price) == 1
	})
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (e *env) do(t *testing.T, method, path, contentType, key string, body []byte) response {
	t.Helper()
	req, err := http.NewRequest(method, e.url+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return response{res.StatusCode, res.Header, b}
}

func (e *env) post(t *testing.T, key, body string) response {
	t.Helper()
	return e.do(t, http.MethodPost, "/orders", "application/json", key, []byte(body))
}

// create places an order of qty units of sku and returns it.
func (e *env) create(t *testing.T, sku string, qty int) Order {
	t.Helper()
	res := e.post(t, uuid.NewString(), fmt.Sprintf(`{"customer_id":"c-1","items":[{"sku":%q,"quantity":%d}]}`, sku, qty))
	if res.status != http.StatusCreated {
		t.Fatalf("POST /orders: %d %s", res.status, res.body)
	}
	return decode[Order](t, res.body)
}

func (e *env) get(t *testing.T, id uuid.UUID) Order {
	t.Helper()
	res := e.do(t, http.MethodGet, "/orders/"+id.String(), "", "", nil)
	if res.status != http.StatusOK {
		t.Fatalf("GET order: %d %s", res.status, res.body)
	}
	return decode[Order](t, res.body)
}

func decode[T any](t *testing.T, b []byte) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return v
}

func (e *env) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitStatus waits until the order is in status.
func (e *env) waitStatus(t *testing.T, id uuid.UUID, status string) Order {
	t.Helper()
	poll.Until(t, 15*time.Second, "order to be "+status, func() bool {
		return e.count(t, `SELECT count(*) FROM orders WHERE order_id = $1 AND status = $2`, id, status) == 1
	})
	return e.get(t, id)
}

// timeouts lists the names of the order's armed saga timeouts, sorted and
// joined by spaces ("" for none).
func (e *env) timeouts(t *testing.T, id uuid.UUID) string {
	t.Helper()
	names := slices.Sorted(maps.Keys(sagatest.Timeouts(t, e.pool, id.String())))
	return strings.Join(names, " ")
}

// sagaState is the state of the order's saga, "" when it has none.
func (e *env) sagaState(t *testing.T, id uuid.UUID) string {
	t.Helper()
	in, err := saga.Load(context.Background(), e.pool, id.String())
	if errors.Is(err, saga.ErrNotFound) {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	return in.State
}

// unexpected counts the events of type typ that the order's saga recorded
// as unexpected, in state (any state when "").
func (e *env) unexpected(t *testing.T, id uuid.UUID, typ, state string) int {
	t.Helper()
	n := 0
	for _, u := range sagatest.UnexpectedEvents(t, e.pool, id.String()) {
		if u.EventType == typ && (state == "" || u.State == state) {
			n++
		}
	}
	return n
}

// written counts the order's outbox events of type typ (any type when "").
func (e *env) written(t *testing.T, id uuid.UUID, typ string) int {
	t.Helper()
	return len(outboxtest.Written(t, e.pool, outboxtest.Want{AggregateType: "order", AggregateID: id.String(), Type: typ}))
}

// deadLetters counts consumer's dead letters.
func (e *env) deadLetters(t *testing.T, consumer string) int {
	t.Helper()
	dead, err := inbox.ListDeadLetters(context.Background(), e.pool, consumer, 1000)
	if err != nil {
		t.Fatal(err)
	}
	return len(dead)
}

// events lists the types of the order's outbox events in sequence order.
func (e *env) events(t *testing.T, id uuid.UUID) []string {
	t.Helper()
	var out []string
	for _, r := range outboxtest.Written(t, e.pool, outboxtest.Want{AggregateType: "order", AggregateID: id.String()}) {
		out = append(out, r.Type)
	}
	return out
}

// payload returns the payload of the order's only event of type typ.
func (e *env) payload(t *testing.T, id uuid.UUID, typ string) map[string]any {
	t.Helper()
	rec := outboxtest.RequireWritten(t, e.pool, outboxtest.Want{AggregateID: id.String(), Type: typ})
	return decode[map[string]any](t, rec.Payload)
}

func statuses(o Order) string {
	var s []string
	for _, h := range o.History {
		s = append(s, h.Status)
	}
	return strings.Join(s, " ")
}

func wantEvents(t *testing.T, got []string, want ...string) {
	t.Helper()
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("outbox events %v, want %v", got, want)
	}
}
