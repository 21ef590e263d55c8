package payment

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

const testSecret = "test-secret"

// testGrace is the tests' Config.CaptureGrace: how long after pay_by an
// intent waits for a payment that arrived before it.
const testGrace = 10 * time.Second

// env is one test's payment service over its own schema and NATS server.
type env struct {
	db       *pgtest.Schema
	js       jetstream.JetStream
	svc      *Service
	router   chi.Router
	provider *FakeProvider

	mu   sync.Mutex
	now  time.Time        // the service's clock
	seqs map[string]int64 // Aggregate-Seq last published per order
}

// setup starts the service with its consumer and refund loop running; they
// stop before the database and the broker do.
func setup(t *testing.T) *env {
	t.Helper()
	e := newEnv(t)
	e.start(t)
	return e
}

// newEnv makes the schema, the broker with ORDERS and PAYMENT, and the
// service, without running it.
func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{
		db:       pgtest.New(t, Registration.Sets()...),
		provider: NewFakeProvider(),
		now:      time.Now(),
		seqs:     map[string]int64{},
	}
	ns := natstest.New(t)
	_, e.js = ns.Connect(t)
	ns.Stream(t, e.js, "ORDERS", "orders.>")
	ns.Stream(t, e.js, "PAYMENT", "payment.>")
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	svc, err := New(registry.Deps{Pool: e.db.Pool, JetStream: e.js, Logger: log}, Config{
		WebhookSecret: testSecret,
		Provider:      e.provider,
		Simulate:      true,
		CaptureGrace:  testGrace,
		Now:           e.clock,
	})
	if err != nil {
		t.Fatal(err)
	}
	e.svc = svc
	e.router = chi.NewRouter()
	svc.Routes(e.router)
	return e
}

// start runs the service's consumer and refund loop until the test ends.
func (e *env) start(t *testing.T) {
	t.Helper()
	svc := e.svc
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func (e *env) clock() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.now
}

func (e *env) advance(d time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.now = e.now.Add(d)
}

// intent puts an intent in place directly, for tests of the HTTP side.
func (e *env) intent(t *testing.T, state string, amount int64) string {
	t.Helper()
	id := uuid.NewString()
	if _, err := e.db.Pool.Exec(context.Background(),
		`INSERT INTO intents (order_id, state, amount) VALUES ($1, $2, $3)`, id, state, amount); err != nil {
		t.Fatal(err)
	}
	return id
}

func (e *env) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := e.db.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// do sends a request through the service's router.
func (e *env) do(t *testing.T, method, path string, body []byte, header http.Header) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest(method, path, bytes.NewReader(body))
	for k, v := range header {
		req.Header[k] = v
	}
	rec := httptest.NewRecorder()
	e.router.ServeHTTP(rec, req)
	return rec
}

// callback posts body to the webhook with the given signature header
// ("" sends none).
func (e *env) callback(t *testing.T, body []byte, sig string) *httptest.ResponseRecorder {
	t.Helper()
	h := http.Header{"Content-Type": {"application/json"}}
	if sig != "" {
		h.Set(SignatureHeader, sig)
	}
	return e.do(t, http.MethodPost, "/webhooks/payment", body, h)
}

// signed posts cb to the webhook, signed now with the right secret.
func (e *env) signed(t *testing.T, cb Callback) *httptest.ResponseRecorder {
	t.Helper()
	body := mustJSON(t, cb)
	return e.callback(t, body, Sign(testSecret, e.clock(), body))
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func wantStatus(t *testing.T, rec *httptest.ResponseRecorder, status int) {
	t.Helper()
	if rec.Code != status {
		t.Fatalf("status %d, want %d; body %s", rec.Code, status, rec.Body)
	}
}

// wantProblem checks a problem response's status and code.
func wantProblem(t *testing.T, rec *httptest.ResponseRecorder, status int, code string) {
	t.Helper()
	wantStatus(t, rec, status)
	var p struct {
		Status int    `json:"status"`
		Code   string `json:"code"`
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("content type %q, want problem+json", ct)
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil {
		t.Fatalf("problem body %s: %v", rec.Body, err)
	}
	if p.Status != status || (code != "" && p.Code != code) {
		t.Fatalf("problem %+v, want status %d code %q", p, status, code)
	}
}

// publish puts an ORDERS event on the stream as the order service's relay
// would: the contract's headers and the order's next Aggregate-Seq. It
// returns the event id.
func (e *env) publish(t *testing.T, orderID, typ string, payload any) uuid.UUID {
	t.Helper()
	e.mu.Lock()
	e.seqs[orderID]++
	seq := e.seqs[orderID]
	e.mu.Unlock()
	id := uuid.Must(uuid.NewV7())
	e.publishMsg(t, orderMsg(id, orderID, typ, seq, 1, mustJSON(t, payload)))
	return id
}

func orderMsg(id uuid.UUID, orderID, typ string, seq int64, version int, data []byte) *nats.Msg {
	m := nats.NewMsg("orders." + orderID + "." + typ)
	m.Header.Set(jetstream.MsgIDHeader, id.String())
	m.Header.Set("Event-Type", typ)
	m.Header.Set("Aggregate-Type", "order")
	m.Header.Set("Aggregate-Id", orderID)
	m.Header.Set("Aggregate-Seq", strconv.FormatInt(seq, 10))
	m.Header.Set("Schema-Version", strconv.Itoa(version))
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339Nano))
	m.Data = data
	return m
}

func (e *env) publishMsg(t *testing.T, m *nats.Msg) *jetstream.PubAck {
	t.Helper()
	return natstest.Publish(t, e.js, m)
}

// settled reports whether payment-orders has acked (or terminated) every
// message in ORDERS.
func (e *env) settled(t *testing.T) bool {
	t.Helper()
	return natstest.Settled(t, e.js, "ORDERS", ConsumerName)
}

func (e *env) intentState(t *testing.T, orderID string) string {
	t.Helper()
	var s string
	err := e.db.Pool.QueryRow(context.Background(), `SELECT state FROM intents WHERE order_id = $1`, orderID).Scan(&s)
	if err != nil {
		return ""
	}
	return s
}

func TestIntentsFollowOrderEvents(t *testing.T) {
	t.Parallel()
	e := setup(t)

	paid := uuid.NewString()
	e.publish(t, paid, "OrderCreated", map[string]any{"order_id": paid, "customer_id": "c-1", "total": 3998,
		"items": []map[string]any{{"sku": "SKU-1", "quantity": 2, "unit_price": 1999}}})
	// OrderCreated opens the intent, and the same transaction announces it:
	// the order shows WAIT_PAY only once it has heard PaymentOpened.
	poll.Until(t, 30*time.Second, "the intent is PAYABLE", func() bool { return e.intentState(t, paid) == StatePayable })
	var intentID string
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT intent_id::text FROM intents WHERE order_id = $1`, paid).Scan(&intentID); err != nil {
		t.Fatal(err)
	}
	opened := e.outboxRows(t, EventPaymentOpened)
	if len(opened) != 1 || opened[0].Subject != "payment."+paid+".PaymentOpened" || opened[0].AggregateID != paid ||
		opened[0].Payload["intent_id"] != intentID || opened[0].Payload["amount"] != float64(3998) {
		t.Fatalf("PaymentOpened %+v, want intent %s of 3998", opened, intentID)
	}
	// OrderAwaitingPayment changes nothing here (the consumer records it
	// without calling the handler).
	e.publish(t, paid, "OrderAwaitingPayment", map[string]any{"order_id": paid, "total": 3998, "pay_by": time.Now(), "intent_id": intentID})
	e.publish(t, paid, "OrderPaid", map[string]any{"order_id": paid, "payment_id": uuid.NewString(), "amount": 3998})
	e.publish(t, paid, "OrderCompleted", map[string]any{"order_id": paid}) // not ours: passes by
	poll.Until(t, 30*time.Second, "the intent is PAID", func() bool { return e.intentState(t, paid) == StatePaid })

	closed := uuid.NewString()
	e.publish(t, closed, "OrderCreated", map[string]any{"order_id": closed, "total": 100})
	e.publish(t, closed, "OrderClosed", map[string]any{"order_id": closed, "reason": "payment_timeout"})
	rejected := uuid.NewString()
	e.publish(t, rejected, "OrderCreated", map[string]any{"order_id": rejected, "total": 100})
	e.publish(t, rejected, "OrderRejected", map[string]any{"order_id": rejected, "reason": "out_of_stock"})
	poll.Until(t, 30*time.Second, "closed and rejected intents are CLOSED", func() bool {
		return e.intentState(t, closed) == StateClosed && e.intentState(t, rejected) == StateClosed
	})
	var amount int64
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT amount FROM intents WHERE order_id = $1`, paid).Scan(&amount); err != nil || amount != 3998 {
		t.Fatalf("amount %d (%v), want 3998", amount, err)
	}

	// A schema version payment does not know is poison: dead-lettered at
	// once, not retried.
	future := uuid.NewString()
	e.publishMsg(t, orderMsg(uuid.Must(uuid.NewV7()), future, "OrderCreated", 1, 2, []byte(`{"order_id":"`+future+`","total":1}`)))
	poll.Until(t, 30*time.Second, "the version-2 event is a dead letter", func() bool {
		dead, err := inbox.ListDeadLetters(context.Background(), e.db.Pool, ConsumerName, 10)
		return err == nil && len(dead) == 1
	})
	if s := e.intentState(t, future); s != "" {
		t.Fatalf("poison event created an intent in state %s", s)
	}
}
