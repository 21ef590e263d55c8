package order

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/pkg/saga/sagatest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

func TestCreateOrder(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 1999)
	e.stock(t, "SKU-2", 500)

	res := e.post(t, "k-1", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2},{"sku":"SKU-2","quantity":1}]}`)
	if res.status != http.StatusCreated {
		t.Fatalf("status %d %s", res.status, res.body)
	}
	o := decode[Order](t, res.body)
	if o.Status != Pending || o.CustomerID != "c-1" || o.Total != 2*1999+500 || len(o.Items) != 2 ||
		o.Items[0] != (Item{SKU: "SKU-1", Quantity: 2, UnitPrice: 1999}) || statuses(o) != Pending {
		t.Fatalf("created order %+v", o)
	}
	if got := e.get(t, o.ID); !got.CreatedAt.Equal(o.CreatedAt) || statuses(got) != Pending || got.Total != o.Total {
		t.Fatalf("GET %+v, want %+v", got, o)
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated")
	p := e.payload(t, o.ID, "OrderCreated")
	if p["order_id"] != o.ID.String() || p["total"] != float64(o.Total) || p["customer_id"] != "c-1" || len(p["items"].([]any)) != 2 {
		t.Fatalf("OrderCreated payload %v", p)
	}
	if rec := outboxtest.RequireWritten(t, e.pool, outboxtest.Want{AggregateID: o.ID.String(), Type: "OrderCreated"}); rec.Subject != "orders."+o.ID.String()+".OrderCreated" {
		t.Fatalf("OrderCreated on %s, want orders.<id>.OrderCreated", rec.Subject)
	}

	t.Run("unknown order is 404", func(t *testing.T) {
		for _, path := range []string{"/orders/" + uuid.NewString(), "/orders/not-a-uuid"} {
			if res := e.do(t, http.MethodGet, path, "", "", nil); res.status != http.StatusNotFound ||
				res.header.Get("Content-Type") != "application/problem+json" {
				t.Errorf("GET %s: %d %s", path, res.status, res.header.Get("Content-Type"))
			}
		}
	})
}

func TestIdempotencyKey(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	body := `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2}]}`

	t.Run("replay returns the same order", func(t *testing.T) {
		first := e.post(t, "replay", body)
		// Same request, other spelling: the hash is of the decoded request.
		again := e.post(t, "replay", `{ "items": [ {"quantity": 2, "sku": "SKU-1"} ], "customer_id": "c-1" }`)
		if first.status != http.StatusCreated || again.status != http.StatusCreated {
			t.Fatalf("statuses %d, %d", first.status, again.status)
		}
		if again.header.Get("Idempotent-Replayed") != "true" || first.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("Idempotent-Replayed: first %q, replay %q", first.header.Get("Idempotent-Replayed"), again.header.Get("Idempotent-Replayed"))
		}
		a, b := decode[Order](t, first.body), decode[Order](t, again.body)
		if a.ID != b.ID || !a.CreatedAt.Equal(b.CreatedAt) {
			t.Fatalf("replay gave order %s, want %s", b.ID, a.ID)
		}
		if n := e.written(t, a.ID, ""); n != 1 {
			t.Fatalf("%d events after a replay, want 1", n)
		}
	})
	t.Run("different body is 422", func(t *testing.T) {
		if res := e.post(t, "reused", body); res.status != http.StatusCreated {
			t.Fatalf("first use of the key: %d %s", res.status, res.body)
		}
		res := e.post(t, "reused", strings.Replace(body, `"quantity":2`, `"quantity":3`, 1))
		if res.status != http.StatusUnprocessableEntity || !strings.Contains(string(res.body), "idempotency-key-reused") {
			t.Fatalf("%d %s", res.status, res.body)
		}
	})
	t.Run("missing or bad key is 400", func(t *testing.T) {
		for name, key := range map[string]string{"missing": "", "too long": strings.Repeat("k", 256), "control character": "a\tb"} {
			res := e.post(t, key, body)
			if res.status != http.StatusBadRequest {
				t.Errorf("%s key: %d %s", name, res.status, res.body)
			}
		}
		if res := e.post(t, strings.Repeat("k", 255), body); res.status != http.StatusCreated {
			t.Errorf("255-character key: %d %s", res.status, res.body)
		}
	})
	t.Run("concurrent twins make one order", func(t *testing.T) {
		var wg sync.WaitGroup
		codes := make([]int, 20)
		for i := range codes {
			wg.Go(func() { codes[i] = e.post(t, "twins", body).status })
		}
		wg.Wait()
		for _, c := range codes {
			if c != http.StatusCreated && c != http.StatusConflict {
				t.Fatalf("twin answered %d", c)
			}
		}
		if n := e.count(t, `SELECT count(*) FROM orders o JOIN idempotency_keys k USING (order_id) WHERE k.key = 'twins'`); n != 1 {
			t.Fatalf("%d orders for one key", n)
		}
	})
	t.Run("expired key can be used again", func(t *testing.T) {
		first := decode[Order](t, e.post(t, "expiring", body).body)
		if _, err := e.pool.Exec(context.Background(), `UPDATE idempotency_keys SET expires_at = now() - interval '1s' WHERE key = 'expiring'`); err != nil {
			t.Fatal(err)
		}
		res := e.post(t, "expiring", body)
		if res.status != http.StatusCreated || res.header.Get("Idempotent-Replayed") != "" || decode[Order](t, res.body).ID == first.ID {
			t.Fatalf("after expiry: %d %s", res.status, res.header)
		}
		if _, err := e.pool.Exec(context.Background(), `UPDATE idempotency_keys SET expires_at = now() - interval '1s' WHERE key = 'expiring'`); err != nil {
			t.Fatal(err)
		}
		if n, err := deleteExpiredKeys(context.Background(), e.pool); err != nil || n != 1 {
			t.Fatalf("deleteExpiredKeys: %d, %v", n, err)
		}
	})
}

func TestBadInputWritesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	e.stock(t, "HUGE", 1<<62)
	item := func(sku string, qty string) string {
		return `{"customer_id":"c-1","items":[{"sku":"` + sku + `","quantity":` + qty + `}]}`
	}
	tooMany := `{"customer_id":"c-1","items":[` + strings.TrimSuffix(strings.Repeat(`{"sku":"SKU-1","quantity":1},`, 101), ",") + `]}`
	for _, tc := range []struct {
		name, contentType, body string
		status                  int
	}{
		{"malformed JSON", "application/json", `{"customer_id":`, 400},
		{"unknown field", "application/json", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}],"coupon":"x"}`, 400},
		{"wrong type", "application/json", item("SKU-1", `"2"`), 400},
		{"trailing data", "application/json", item("SKU-1", "1") + `{}`, 400},
		{"wrong content type", "text/plain", item("SKU-1", "1"), 415},
		{"1 MB body", "application/json", `{"customer_id":"` + strings.Repeat("x", 1<<20) + `"}`, 413},
		{"unknown SKU", "application/json", item("NOPE", "1"), 422},
		{"bad SKU syntax", "application/json", item("SKU 1", "1"), 422},
		{"quantity 0", "application/json", item("SKU-1", "0"), 422},
		{"quantity -1", "application/json", item("SKU-1", "-1"), 422},
		{"quantity 100000", "application/json", item("SKU-1", "100000"), 422},
		{"no items", "application/json", `{"customer_id":"c-1","items":[]}`, 422},
		{"101 lines", "application/json", tooMany, 422},
		{"duplicate SKU", "application/json", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1},{"sku":"SKU-1","quantity":2}]}`, 422},
		{"no customer", "application/json", `{"items":[{"sku":"SKU-1","quantity":1}]}`, 422},
		{"customer id too long", "application/json", `{"customer_id":"` + strings.Repeat("c", 65) + `","items":[{"sku":"SKU-1","quantity":1}]}`, 422},
		{"customer id of 65 emoji", "application/json", `{"customer_id":"` + strings.Repeat("\U0001F600", 65) + `","items":[{"sku":"SKU-1","quantity":1}]}`, 422},
		{"total overflows", "application/json", item("HUGE", "1000"), 422},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "bad-" + tc.name
			res := e.do(t, http.MethodPost, "/orders", tc.contentType, key, []byte(tc.body))
			if res.status != tc.status || res.header.Get("Content-Type") != "application/problem+json" {
				t.Fatalf("%d %s %s, want %d problem+json", res.status, res.header.Get("Content-Type"), res.body, tc.status)
			}
			if n := e.count(t, `SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM idempotency_keys)
				+ (SELECT count(*) FROM outbox WHERE aggregate_type = 'order') + (SELECT count(*) FROM saga_instances)`); n != 0 {
				t.Fatalf("a refused request wrote %d rows", n)
			}
			// Nothing was stored under the key either: it is still free.
			if res := e.post(t, key, item("SKU-1", "1")); res.status != http.StatusCreated {
				t.Fatalf("the key of a refused request: %d %s", res.status, res.body)
			}
			if _, err := e.pool.Exec(context.Background(), `
				TRUNCATE orders, order_items, order_history, idempotency_keys, saga_instances, saga_timeouts, outbox CASCADE`); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The contract's maxLength of 64 counts characters, as JSON Schema does: 64
// four-byte emoji (256 bytes) are a customer id, and it is stored as sent.
func TestCustomerIDLengthCountsCharacters(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	customer := strings.Repeat("\U0001F600", maxCustomerLen)
	res := e.post(t, "emoji-64", `{"customer_id":"`+customer+`","items":[{"sku":"SKU-1","quantity":1}]}`)
	if res.status != http.StatusCreated {
		t.Fatalf("64 four-byte emoji: %d %s, want 201", res.status, res.body)
	}
	if o := decode[Order](t, res.body); o.CustomerID != customer {
		t.Fatalf("customer_id stored as %q", o.CustomerID)
	}
}

func TestFailedWriteWritesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	body := `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`
	// The last write of the order's batch, the key's record, fails: nothing
	// the batch sent before it may stay.
	for _, q := range []string{
		`CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$`,
		`CREATE TRIGGER refuse BEFORE INSERT ON idempotency_keys FOR EACH ROW EXECUTE FUNCTION refuse()`,
	} {
		if _, err := e.pool.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	if res := e.post(t, "k", body); res.status != http.StatusInternalServerError {
		t.Fatalf("%d %s, want 500", res.status, res.body)
	}
	if n := e.count(t, `SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM order_history)
		+ (SELECT count(*) FROM outbox WHERE aggregate_type = 'order') + (SELECT count(*) FROM saga_instances)`); n != 0 {
		t.Fatalf("a failed order wrote %d rows", n)
	}

	// The failed attempt holds nothing either (the key's lock went with
	// the rollback): the retry creates the order.
	if _, err := e.pool.Exec(context.Background(), `DROP TRIGGER refuse ON idempotency_keys`); err != nil {
		t.Fatal(err)
	}
	if res := e.post(t, "k", body); res.status != http.StatusCreated || res.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("retry: %d %s", res.status, res.body)
	}
}

func TestCancel(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	cancel := func(t *testing.T, id uuid.UUID) response {
		return e.do(t, http.MethodPost, "/orders/"+id.String()+"/cancel", "", "", nil)
	}

	t.Run("pending", func(t *testing.T) {
		o := e.create(t, "SKU-1", 1)
		if res := cancel(t, o.ID); res.status != http.StatusAccepted {
			t.Fatalf("cancel: %d %s", res.status, res.body)
		}
		got := e.get(t, o.ID)
		if got.Status != Closed || statuses(got) != "PENDING CLOSED" || got.History[1].Reason != reasonCustomerCancel {
			t.Fatalf("after cancel: %+v", got)
		}
		wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderClosed")
		if p := e.payload(t, o.ID, "OrderClosed"); p["reason"] != reasonCustomerCancel {
			t.Fatalf("OrderClosed %v", p)
		}
	})
	// While one of the two answers to OrderCreated is in, the order shows
	// PENDING, and a cancel closes it as it would any PENDING order.
	for _, answer := range []struct{ prefix, typ string }{{"inventory", "InventoryReserved"}, {"payment", "PaymentOpened"}} {
		t.Run("pending after "+answer.typ, func(t *testing.T) {
			o := e.create(t, "SKU-1", 1)
			e.publish(t, answer.prefix, o.ID, answer.typ, map[string]any{"order_id": o.ID, "intent_id": uuid.New(), "items": []any{}})
			poll.Until(t, 15*time.Second, "the saga to take "+answer.typ, func() bool {
				s := e.sagaState(t, o.ID)
				return s != "" && s != "PENDING"
			})
			if res := cancel(t, o.ID); res.status != http.StatusAccepted {
				t.Fatalf("cancel: %d %s", res.status, res.body)
			}
			if got := e.get(t, o.ID); got.Status != Closed || statuses(got) != "PENDING CLOSED" {
				t.Fatalf("after cancel: %s %s", got.Status, statuses(got))
			}
			if got := e.timeouts(t, o.ID); got != "" {
				t.Fatalf("timeouts after the cancel: %q, want none", got)
			}
		})
	}
	t.Run("waiting for payment", func(t *testing.T) {
		o := e.create(t, "SKU-1", 1)
		e.payable(t, o.ID, true)
		e.waitStatus(t, o.ID, WaitPay)
		if res := cancel(t, o.ID); res.status != http.StatusAccepted {
			t.Fatalf("cancel: %d %s", res.status, res.body)
		}
		if got := e.get(t, o.ID); statuses(got) != "PENDING WAIT_PAY CLOSED" {
			t.Fatalf("history %s", statuses(got))
		}
		wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderAwaitingPayment", "OrderClosed")
		if got := e.timeouts(t, o.ID); got != "" {
			t.Fatalf("timeouts %q outlived the cancel", got)
		}
	})
	t.Run("paid is 409", func(t *testing.T) {
		o := e.create(t, "SKU-1", 1)
		e.payable(t, o.ID, false)
		e.waitStatus(t, o.ID, WaitPay)
		e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "p-1", "amount": 100})
		e.waitStatus(t, o.ID, Paid)
		if res := cancel(t, o.ID); res.status != http.StatusConflict {
			t.Fatalf("cancel: %d %s", res.status, res.body)
		}
		if n := len(sagatest.UnexpectedEvents(t, e.pool, o.ID.String())); n != 0 {
			t.Fatal("a refused cancel wrote a row")
		}
		if got := e.get(t, o.ID); got.Status != Paid {
			t.Fatalf("status %s after a refused cancel", got.Status)
		}
	})
	t.Run("unknown is 404", func(t *testing.T) {
		if res := cancel(t, uuid.New()); res.status != http.StatusNotFound {
			t.Fatalf("cancel: %d %s", res.status, res.body)
		}
	})
}

// A database failure under POST /orders is a 503 the client can act on: it
// says when and how to retry (the same Idempotency-Key), and the retry
// settles the order exactly once, whether or not the failed attempt
// committed.
func TestDatabaseFailureIs503(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	body := `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`
	want503 := func(t *testing.T, res response) {
		t.Helper()
		p := decode[httpx.Problem](t, res.body)
		if res.status != http.StatusServiceUnavailable || p.Code != "dependency-unavailable" || res.header.Get("Retry-After") != "1" ||
			res.header.Get("Content-Type") != "application/problem+json" || !strings.Contains(p.Detail, "same Idempotency-Key") {
			t.Fatalf("%d Retry-After %q %s, want 503 dependency-unavailable with Retry-After", res.status, res.header.Get("Retry-After"), res.body)
		}
	}

	t.Run("connection lost mid-transaction", func(t *testing.T) {
		// The session dies while writing the key's record, the last write
		// of the order's batch, as when Postgres restarts or an operator
		// runs pg_terminate_backend.
		for _, q := range []string{
			`CREATE FUNCTION die() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); RETURN NEW; END $$`,
			`CREATE TRIGGER die BEFORE INSERT ON idempotency_keys FOR EACH ROW WHEN (NEW.key = 'doomed') EXECUTE FUNCTION die()`,
		} {
			if _, err := e.pool.Exec(context.Background(), q); err != nil {
				t.Fatal(err)
			}
		}
		want503(t, e.post(t, "doomed", body))
		if n := e.count(t, `SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM idempotency_keys WHERE key = 'doomed')`); n != 0 {
			t.Fatalf("the failed attempt wrote %d rows", n)
		}
		if _, err := e.pool.Exec(context.Background(), `DROP TRIGGER die ON idempotency_keys`); err != nil {
			t.Fatal(err)
		}
		res := e.post(t, "doomed", body)
		if res.status != http.StatusCreated || res.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("retry with the same key: %d %s", res.status, res.body)
		}
		if again := e.post(t, "doomed", body); again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "true" ||
			decode[Order](t, again.body).ID != decode[Order](t, res.body).ID {
			t.Fatalf("second retry: %d %s", again.status, again.body)
		}
	})

	t.Run("database unreachable", func(t *testing.T) {
		// Nothing listens on port 1: every request's first query fails.
		pool, err := database.NewPool(context.Background(), "postgres://postgres@127.0.0.1:1/shop?connect_timeout=2", "orders", 1)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		svc, err := New(registry.Deps{Pool: pool, JetStream: e.js}, Config{})
		if err != nil {
			t.Fatal(err)
		}
		r := chi.NewRouter()
		svc.Routes(r)
		hs := httptest.NewServer(r)
		t.Cleanup(hs.Close)
		down := &env{url: hs.URL}
		want503(t, down.post(t, "unreachable", body))
		want503(t, down.do(t, http.MethodGet, "/orders/"+uuid.NewString(), "", "", nil))
		want503(t, down.do(t, http.MethodPost, "/orders/"+uuid.NewString()+"/cancel", "", "", nil))
	})
}

// A twin in flight is a 409 that says when to try again.
func TestRequestInFlightSaysRetryAfter(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	key := "held-" + uuid.NewString()
	// The twin's transaction holds the key's advisory lock; so does this one.
	tx, err := e.pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck
	if _, err := tx.Exec(context.Background(), `SELECT pg_advisory_xact_lock(`+keyLockID+`)`, key); err != nil {
		t.Fatal(err)
	}
	res := e.post(t, key, `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`)
	if p := decode[httpx.Problem](t, res.body); res.status != http.StatusConflict || p.Code != "request-in-flight" || res.header.Get("Retry-After") != "1" {
		t.Fatalf("%d Retry-After %q %s, want 409 request-in-flight with Retry-After: 1", res.status, res.header.Get("Retry-After"), res.body)
	}
}

// Another shop's order service in the same database (another schema) that
// holds the same Idempotency-Key in flight is not a twin of this request.
func TestAnotherSchemasKeyInFlightIsNoTwin(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	ctx := context.Background()
	other := pgtest.New(t, Registration.Sets()...)
	tx, err := other.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var locked bool
	if err := tx.QueryRow(ctx, keyLockSQL, "shared-key").Scan(&locked); err != nil || !locked {
		t.Fatalf("the other schema's lock: %v %v", locked, err)
	}
	res := e.post(t, "shared-key", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`)
	if res.status != http.StatusCreated {
		t.Fatalf("POST /orders while another schema holds the key: %d %s", res.status, res.body)
	}
}
