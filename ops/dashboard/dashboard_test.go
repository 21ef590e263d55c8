package dashboard_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shop-ref/shop/ops/dashboard"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// schemas migrates every service's schema for one test and returns them as
// the dashboard reads them, with an exec that fails t on an error.
func schemas(t *testing.T) (map[string]dashboard.DB, func(service, sql string, args ...any)) {
	t.Helper()
	pools := map[string]dashboard.DB{}
	for name, p := range shoptest.Schemas(t, services.All).Pools {
		pools[name] = p
	}
	return pools, func(service, sql string, args ...any) {
		t.Helper()
		if _, err := pools[service].Exec(context.Background(), sql, args...); err != nil {
			t.Fatalf("%s: %v", service, err)
		}
	}
}

// setupState returns a dashboard over four freshly migrated service schemas
// holding: two PENDING orders and one COMPLETED, two published events in the
// order outbox and one in payment's, one pending event in inventory's outbox
// and one open dead letter in fulfillment's.
func setupState(t *testing.T) (*httptest.Server, []string) {
	t.Helper()
	pools, exec := schemas(t)
	now := time.Now()
	var ids []string
	for i, status := range []string{"PENDING", "PENDING", "COMPLETED"} {
		id := uuid.NewString()
		ids = append(ids, id)
		exec("order", `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at)
			VALUES ($1, 'c-1', $2, 1999, $3, $3)`, id, status, now.Add(time.Duration(i)*time.Second))
	}
	event := func(service, subject, typ string, published *time.Time) {
		t.Helper()
		exec(service, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
			schema_version, subject, payload, published_at) VALUES ($1, 'x', $2, 1, $3, 1, $4, '{}', $5)`,
			uuid.New(), uuid.NewString(), typ, subject, published)
	}
	t1, t2, t3 := now.Add(-3*time.Second), now.Add(-2*time.Second), now.Add(-time.Second)
	event("order", "orders.1.OrderCreated", "OrderCreated", &t1)
	event("order", "orders.1.OrderPaid", "OrderPaid", &t3)
	event("payment", "payment.1.PaymentSucceeded", "PaymentSucceeded", &t2)
	event("inventory", "inventory.1.InventoryReserved", "InventoryReserved", nil)
	exec("fulfillment", `INSERT INTO dead_letters (consumer_name, stream, stream_seq, subject, headers, payload,
		error, attempts, first_failed_at, last_failed_at) VALUES ('c', 'ORDERS', 1, 's', '{}', '', 'boom', 5, now(), now())`)
	exec("payment", `INSERT INTO dead_letters (consumer_name, stream, stream_seq, subject, headers, payload,
		error, attempts, first_failed_at, last_failed_at, conflict_with)
		VALUES ('c', 'ORDERS', 2, 's', '{}', '', 'conflict', 1, now(), now(), gen_random_uuid())`)
	exec("payment", `INSERT INTO inbox_parked (consumer_name, source, aggregate_type, aggregate_id, aggregate_seq, event_id,
		stream, stream_seq, subject, headers, payload, parked_at)
		VALUES ('c', 'orders', 'order', 'o-9', 3, gen_random_uuid(), 'ORDERS', 3, 'orders.o-9.X', '{}', '', now() - interval '90 seconds')`)

	d, err := dashboard.New(dashboard.Config{Pools: pools, OrderURL: "http://order", PaymentURL: "http://payment",
		PaymentTimeout: 15 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	return srv, ids
}

func TestState(t *testing.T) {
	t.Parallel()
	srv, ids := setupState(t)

	t.Run("has the documented shape", func(t *testing.T) {
		res, err := http.Get(srv.URL + "/api/state")
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		if res.StatusCode != http.StatusOK || res.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("got %s %s", res.Status, res.Header.Get("Content-Type"))
		}
		var raw map[string]json.RawMessage
		if err := json.NewDecoder(res.Body).Decode(&raw); err != nil {
			t.Fatal(err)
		}
		for _, key := range []string{"at", "payment_timeout", "can_pay", "counts", "orders", "outbox", "events", "dead_letters"} {
			if _, ok := raw[key]; !ok {
				t.Errorf("no %q in the state", key)
			}
		}
		var orders, outbox, events []map[string]any
		for key, dst := range map[string]*[]map[string]any{"orders": &orders, "outbox": &outbox, "events": &events} {
			if err := json.Unmarshal(raw[key], dst); err != nil || len(*dst) == 0 {
				t.Fatalf("%s: %v %s", key, err, raw[key])
			}
		}
		wantKeys(t, orders[0], "order_id", "status", "total", "updated_at", "customer_id", "items", "reason")
		if string(raw["currency"]) != `"EUR"` {
			t.Errorf("currency = %s, want \"EUR\"", raw["currency"])
		}
		wantKeys(t, outbox[0], "service", "pending", "oldest_pending_seconds", "dead")
		wantKeys(t, events[0], "service", "subject", "type", "published_at")
	})

	t.Run("reads every schema", func(t *testing.T) {
		st := getState(t, srv.URL)
		if st.PaymentTimeout != "15m0s" {
			t.Errorf("payment_timeout = %q", st.PaymentTimeout)
		}
		want := map[string]int{"PENDING": 2, "WAIT_PAY": 0, "PAID": 0, "FULFILLING": 0, "COMPLETED": 1, "REJECTED": 0, "CLOSED": 0}
		for s, n := range want {
			if got, ok := st.Counts[s]; !ok || got != n {
				t.Errorf("counts[%s] = %d (present: %v), want %d", s, got, ok, n)
			}
		}
		if len(st.Orders) != 3 || st.Orders[0].ID != ids[2] || st.Orders[0].Status != "COMPLETED" {
			t.Errorf("orders, newest first: %+v", st.Orders)
		}
		var types []string
		for _, e := range st.Events {
			types = append(types, e.Service+":"+e.Type)
		}
		if got := strings.Join(types, " "); got != "order:OrderPaid payment:PaymentSucceeded order:OrderCreated" {
			t.Errorf("events, newest first: %s", got)
		}
		backlog := map[string]dashboard.Backlog{}
		for _, b := range st.Outbox {
			backlog[b.Service] = b
		}
		if b := backlog["inventory"]; len(st.Outbox) != len(services.All) || b.Pending != 1 || b.OldestPending <= 0 {
			t.Errorf("outbox: %+v", st.Outbox)
		}
		byService := map[string]dashboard.DeadLetters{}
		for _, d := range st.DeadLetters {
			byService[d.Service] = d
		}
		if f, p := byService["fulfillment"], byService["payment"]; len(byService) != len(services.All) || f.Open != 1 || f.Conflicts != 0 ||
			byService["order"].Open != 0 || p.Open != 1 || p.Conflicts != 1 || p.Parked != 1 || p.OldestParked < 90 {
			t.Errorf("dead letters: %+v", st.DeadLetters)
		}
	})

	t.Run("streams it as server-sent events", func(t *testing.T) {
		res, err := http.Get(srv.URL + "/api/events")
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		if ct := res.Header.Get("Content-Type"); ct != "text/event-stream" {
			t.Fatalf("Content-Type %q", ct)
		}
		sc := bufio.NewScanner(res.Body)
		sc.Buffer(nil, 1<<20)
		var events int
		for events < 2 && sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			var st dashboard.State
			if err := json.Unmarshal([]byte(data), &st); err != nil || st.Counts["PENDING"] != 2 {
				t.Fatalf("event %d: %v %s", events, err, data)
			}
			events++
		}
		if events < 2 {
			t.Fatalf("got %d events: %v", events, sc.Err())
		}
	})

	t.Run("serves an order's journey", func(t *testing.T) {
		for path, want := range map[string]int{
			"/api/orders/" + ids[2] + "/journey":           http.StatusOK,
			"/api/orders/" + uuid.NewString() + "/journey": http.StatusNotFound,
			"/api/orders/not-a-uuid/journey":               http.StatusBadRequest,
		} {
			res, err := http.Get(srv.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			var body map[string]any
			err = json.NewDecoder(res.Body).Decode(&body)
			res.Body.Close()
			if res.StatusCode != want || err != nil || res.Header.Get("Content-Type") != "application/json" {
				t.Errorf("GET %s: %s %v, want %d", path, res.Status, err, want)
				continue
			}
			if want == http.StatusOK {
				wantKeys(t, body, "order_id", "status", "entries", "timeouts", "notes")
				if body["order_id"] != ids[2] || body["status"] != "COMPLETED" {
					t.Errorf("journey: %v", body)
				}
			} else if body["error"] == "" {
				t.Errorf("GET %s: no error in %v", path, body)
			}
		}
	})

	t.Run("serves the page", func(t *testing.T) {
		for path, want := range map[string]string{
			"/":                 "Place an order",
			"/static/app.js":    "EventSource",
			"/static/style.css": ".board",
		} {
			res, err := http.Get(srv.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
				t.Errorf("GET %s: %s, want a body with %q", path, res.Status, want)
			}
		}
	})
}

func TestStateWithoutSchemas(t *testing.T) {
	t.Parallel()
	// Before the services have migrated, reads fail: the API says so, and
	// the page keeps trying.
	srv := demoServer(t, "http://order", "http://payment")
	res, err := http.Get(srv.URL + "/api/state")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var body map[string]string
	_ = json.NewDecoder(res.Body).Decode(&body)
	if res.StatusCode != http.StatusServiceUnavailable || body["error"] == "" {
		t.Fatalf("got %s %v", res.Status, body)
	}
}

func TestDemoOrder(t *testing.T) {
	t.Parallel()
	var (
		mu   sync.Mutex
		keys []string
	)
	order := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			CustomerID string `json:"customer_id"`
			Items      []struct {
				SKU      string `json:"sku"`
				Quantity int    `json:"quantity"`
			} `json:"items"`
		}
		err := json.NewDecoder(r.Body).Decode(&req)
		if r.Method != http.MethodPost || r.URL.Path != "/orders" || r.Header.Get("Content-Type") != "application/json" ||
			err != nil || req.CustomerID == "" || len(req.Items) != 1 || req.Items[0].SKU != "SKU-1" || req.Items[0].Quantity != 1 {
			t.Errorf("order service got %s %s %+v (%v)", r.Method, r.URL.Path, req, err)
		}
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"order_id":"0193b5f0-0000-7000-8000-000000000001","status":"PENDING"}`)
	}))
	defer order.Close()
	srv := demoServer(t, order.URL, "http://payment.invalid")

	for range 2 {
		status, body := post(t, srv.URL+"/api/demo/order")
		if status != http.StatusCreated || body["order_id"] != "0193b5f0-0000-7000-8000-000000000001" || body["status"] != "PENDING" {
			t.Fatalf("got %d %v", status, body)
		}
	}
	if len(keys) != 2 || keys[0] == "" || keys[0] == keys[1] {
		t.Errorf("Idempotency-Keys %q: want a fresh one per order", keys)
	}

	t.Run("passes a refusal through", func(t *testing.T) {
		refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusUnprocessableEntity)
			_, _ = io.WriteString(w, `{"code":"unknown-sku","detail":"no SKU-1"}`)
		}))
		defer refusing.Close()
		status, body := post(t, demoServer(t, refusing.URL, "http://payment.invalid").URL+"/api/demo/order")
		if status != http.StatusUnprocessableEntity || body["detail"] != "no SKU-1" {
			t.Fatalf("got %d %v", status, body)
		}
	})

	t.Run("answers 502 when the service is down", func(t *testing.T) {
		down := httptest.NewServer(http.NotFoundHandler())
		down.Close()
		status, body := post(t, demoServer(t, down.URL, "http://payment.invalid").URL+"/api/demo/order")
		if status != http.StatusBadGateway || body["error"] == nil {
			t.Fatalf("got %d %v", status, body)
		}
	})
}

func TestDemoPay(t *testing.T) {
	t.Parallel()
	id := uuid.NewString()
	var calls atomic.Int32
	payment := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Outcome string }
		_ = json.NewDecoder(r.Body).Decode(&req)
		if r.Method != http.MethodPost || r.URL.Path != "/payments/"+id+"/simulate" || req.Outcome != "succeeded" {
			t.Errorf("payment service got %s %s %+v", r.Method, r.URL.Path, req)
		}
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"status":"succeeded"}`)
	}))
	defer payment.Close()
	srv := demoServer(t, "http://order.invalid", payment.URL)

	t.Run("pays with one call", func(t *testing.T) {
		status, body := post(t, srv.URL+"/api/demo/pay/"+id)
		if status != http.StatusOK || body["status"] != "succeeded" || calls.Load() != 1 {
			t.Fatalf("got %d %v after %d calls", status, body, calls.Load())
		}
	})
	t.Run("refuses an id that is no UUID", func(t *testing.T) {
		if status, body := post(t, srv.URL+"/api/demo/pay/not-a-uuid"); status != http.StatusBadRequest {
			t.Fatalf("got %d %v", status, body)
		}
	})
	t.Run("without the fake provider, says so and calls nothing", func(t *testing.T) {
		d, err := dashboard.New(dashboard.Config{Pools: map[string]dashboard.DB{"order": failingDB{}},
			OrderURL: "http://order.invalid", PaymentURL: payment.URL, Demo: true})
		if err != nil {
			t.Fatal(err)
		}
		off := httptest.NewServer(d)
		defer off.Close()
		before := calls.Load()
		status, body := post(t, off.URL+"/api/demo/pay/"+id)
		if msg, _ := body["error"].(string); status != http.StatusConflict || !strings.Contains(msg, "PAYMENT_FAKE_PROVIDER") || calls.Load() != before {
			t.Fatalf("got %d %v, %d calls", status, body, calls.Load()-before)
		}
	})
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	if _, err := dashboard.New(dashboard.Config{OrderURL: "http://o", PaymentURL: "http://p"}); err == nil {
		t.Error("no order pool: want an error")
	}
	if _, err := dashboard.New(dashboard.Config{Pools: map[string]dashboard.DB{"order": failingDB{}}}); err == nil {
		t.Error("no service URLs: want an error")
	}
	if _, err := dashboard.New(dashboard.Config{Pools: map[string]dashboard.DB{"order": failingDB{}},
		OrderURL: "http://o", PaymentURL: "http://p", TraceUIURL: "http://jaeger/trace/"}); err == nil {
		t.Error("a TraceUIURL without {trace_id}: want an error")
	}
	for _, h := range []string{"", "http://shop.example", "shop.example/x"} {
		if _, err := dashboard.New(dashboard.Config{Pools: map[string]dashboard.DB{"order": failingDB{}},
			OrderURL: "http://o", PaymentURL: "http://p", Hosts: []string{h}}); err == nil {
			t.Errorf("Hosts %q: want an error", h)
		}
	}
}

// TestTraceLink: with TraceUIURL set, an order whose first event was written
// under a trace links to that trace; an order with no trace context in its
// events links nowhere; without TraceUIURL nothing links.
func TestTraceLink(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pools, _ := schemas(t)
	traced, untraced := uuid.NewString(), uuid.NewString()
	for _, id := range []string{traced, untraced} {
		if _, err := pools["order"].Exec(ctx, `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at)
			VALUES ($1, 'c-1', 'PENDING', 1999, now(), now())`, id); err != nil {
			t.Fatal(err)
		}
	}
	event := func(id string, seq int, headers string) {
		t.Helper()
		if _, err := pools["order"].Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
			schema_version, subject, payload, headers) VALUES ($1, 'order', $2, $3, 'OrderCreated', 1, 'orders.x.OrderCreated', '{}', $4)`,
			uuid.Must(uuid.NewV7()), id, seq, headers); err != nil {
			t.Fatal(err)
		}
	}
	event(traced, 1, `{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`)
	event(traced, 2, `{"traceparent":"00-11111111111111111111111111111111-00f067aa0ba902b7-01"}`) // a later event's: not the order's first
	event(untraced, 1, `{}`)

	for _, tc := range []struct {
		template string
		want     map[string]string
	}{
		{"http://localhost:16686/trace/{trace_id}", map[string]string{
			traced: "http://localhost:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736", untraced: ""}},
		{"", map[string]string{traced: "", untraced: ""}},
	} {
		d, err := dashboard.New(dashboard.Config{Pools: pools, OrderURL: "http://o", PaymentURL: "http://p", TraceUIURL: tc.template})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(d)
		st := getState(t, srv.URL)
		srv.Close()
		for _, o := range st.Orders {
			if o.TraceURL != tc.want[o.ID] {
				t.Errorf("template %q: order %s links to %q, want %q", tc.template, o.ID, o.TraceURL, tc.want[o.ID])
			}
		}
	}
}

// demoServer serves a dashboard in demo mode, with Pay, whose database
// reads all fail.
func demoServer(t *testing.T, orderURL, paymentURL string) *httptest.Server {
	t.Helper()
	d, err := dashboard.New(dashboard.Config{Pools: map[string]dashboard.DB{"order": failingDB{}},
		OrderURL: orderURL, PaymentURL: paymentURL, Demo: true, CanPay: true})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	return srv
}

// failingDB is a database that is not there yet.
type failingDB struct{}

var errNoDB = &pgconn.PgError{Code: "3F000", Message: `schema "orders" does not exist`}

func (failingDB) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errNoDB
}
func (failingDB) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, errNoDB }
func (failingDB) QueryRow(context.Context, string, ...any) pgx.Row        { return errRow{} }

type errRow struct{}

func (errRow) Scan(...any) error { return errNoDB }

func getState(t *testing.T, base string) dashboard.State {
	t.Helper()
	res, err := http.Get(base + "/api/state")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var st dashboard.State
	if err := json.NewDecoder(res.Body).Decode(&st); err != nil || res.StatusCode != http.StatusOK {
		t.Fatalf("GET /api/state: %s %v", res.Status, err)
	}
	return st
}

func post(t *testing.T, url string) (int, map[string]any) {
	t.Helper()
	res, err := http.Post(url, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var body map[string]any
	_ = json.NewDecoder(res.Body).Decode(&body)
	return res.StatusCode, body
}

func wantKeys(t *testing.T, m map[string]any, keys ...string) {
	t.Helper()
	for _, k := range keys {
		if _, ok := m[k]; !ok {
			t.Errorf("no %q in %v", k, m)
		}
	}
}
