package order

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/go-chi/chi/v5"

	"github.com/shop-ref/shop/internal/registry"
)

// POST /orders ends its transaction in the batch that writes (COMMIT rides
// with the writes), so no pgx.Tx ends it: every other way out — a replay,
// a reused key, a twin in flight, an unknown SKU, a failed write — must
// roll back itself and hand the connection back to the pool outside any
// transaction, or the next request on that connection would run inside a
// stranger's transaction (or the pool would close it, a new connection per
// refusal). One connection serves every request here, so each must find it
// clean.
func TestEveryAnswerLeavesTheConnectionClean(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	pool := e.db.NewPool(t, 1)
	svc, err := New(registry.Deps{Pool: pool, JetStream: e.js}, Config{})
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	svc.Routes(r)
	hs := httptest.NewServer(r)
	t.Cleanup(hs.Close)
	one := &env{url: hs.URL}
	body := `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`

	if res := one.post(t, "first", body); res.status != http.StatusCreated {
		t.Fatalf("first order: %d %s", res.status, res.body)
	}
	conns := pool.Stat().NewConnsCount()

	// A twin in flight: another session holds the key's lock.
	held, err := e.pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := held.Exec(context.Background(), `SELECT pg_advisory_xact_lock(`+keyLockID+`)`, "held"); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		name, key, body string
		want            int
	}{
		{"replay", "first", body, http.StatusCreated},
		{"key reused", "first", `{"customer_id":"c-2","items":[{"sku":"SKU-1","quantity":1}]}`, http.StatusUnprocessableEntity},
		{"twin in flight", "held", body, http.StatusConflict},
		{"unknown sku", "unknown", `{"customer_id":"c-1","items":[{"sku":"SKU-9","quantity":1}]}`, http.StatusUnprocessableEntity},
	}
	for _, s := range steps {
		if res := one.post(t, s.key, s.body); res.status != s.want {
			t.Fatalf("%s: %d %s, want %d", s.name, res.status, res.body, s.want)
		}
	}
	if err := held.Rollback(context.Background()); err != nil {
		t.Fatal(err)
	}
	// A write that fails: the key's record is refused.
	for _, q := range []string{
		`CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$`,
		`CREATE TRIGGER refuse BEFORE INSERT ON idempotency_keys FOR EACH ROW WHEN (NEW.key = 'refused') EXECUTE FUNCTION refuse()`,
	} {
		if _, err := e.pool.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	if res := one.post(t, "refused", body); res.status != http.StatusInternalServerError {
		t.Fatalf("failed write: %d %s, want 500", res.status, res.body)
	}

	// The same connection, never replaced, creates the next order, and the
	// order is there for everyone: it committed.
	res := one.post(t, "second", body)
	if res.status != http.StatusCreated || res.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("second order: %d %s", res.status, res.body)
	}
	if n := pool.Stat().NewConnsCount(); n != conns {
		t.Fatalf("the pool opened %d connections after the first order; want none: a refusal left its connection in a transaction", n-conns)
	}
	o := decode[Order](t, res.body)
	if n := e.count(t, `SELECT count(*) FROM orders WHERE order_id = $1`, o.ID); n != 1 {
		t.Fatal("the second order is not visible to another session")
	}
}

// OrderCreated's payload is a struct now; consumers and stored events
// were written against the map it replaced, so its bytes must not differ.
func TestOrderCreatedPayloadKeepsItsBytes(t *testing.T) {
	t.Parallel()
	o, err := newOrder(createRequest{CustomerID: "c-\"1\"", Items: []struct {
		SKU      string `json:"sku"`
		Quantity int    `json:"quantity"`
	}{{"SKU-1", 2}, {"SKU-2", 1}}}, map[string]int64{"SKU-1": 1999, "SKU-2": 500})
	if err != nil {
		t.Fatal(err)
	}
	got, err := json.Marshal(orderCreated(o).Payload)
	if err != nil {
		t.Fatal(err)
	}
	type line struct {
		SKU       string `json:"sku"`
		Quantity  int    `json:"quantity"`
		UnitPrice int64  `json:"unit_price"`
	}
	want, err := json.Marshal(map[string]any{
		"order_id":    o.ID,
		"customer_id": o.CustomerID,
		"items":       []line{{"SKU-1", 2, 1999}, {"SKU-2", 1, 500}},
		"total":       o.Total,
		"created_at":  o.CreatedAt,
	})
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Fatalf("OrderCreated payload\n got %s\nwant %s", got, want)
	}
}

// The COMMIT rides in the write batch; when it is COMMIT itself that fails
// (here a deferred constraint trigger, checked only at commit, refuses the
// key's record), the request must fail as a failed write does: no 201,
// nothing written, and a retry with the same key creates the order.
func TestFailedCommitWritesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	body := `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`
	for _, q := range []string{
		`CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$`,
		`CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON idempotency_keys DEFERRABLE INITIALLY DEFERRED
			FOR EACH ROW WHEN (NEW.key = 'late') EXECUTE FUNCTION refuse_at_commit()`,
	} {
		if _, err := e.pool.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	if res := e.post(t, "late", body); res.status != http.StatusInternalServerError {
		t.Fatalf("%d %s, want 500", res.status, res.body)
	}
	if n := e.count(t, `SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM idempotency_keys)
		+ (SELECT count(*) FROM outbox WHERE aggregate_type = 'order') + (SELECT count(*) FROM saga_instances)`); n != 0 {
		t.Fatalf("a failed commit left %d rows", n)
	}
	if _, err := e.pool.Exec(context.Background(), `DROP TRIGGER refuse_at_commit ON idempotency_keys`); err != nil {
		t.Fatal(err)
	}
	if res := e.post(t, "late", body); res.status != http.StatusCreated || res.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("retry: %d %s", res.status, res.body)
	}
}
