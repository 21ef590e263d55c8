package e2e

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// A database failure while POST /orders writes is a 503 with Retry-After
// and a problem that says to retry with the same key; the retry creates the
// order, once. The order service's own session dies mid-transaction (it
// terminates itself from a trigger on its key's row), as when Postgres
// restarts or an operator runs pg_terminate_backend.
func TestDatabaseFailureDuringCreateIs503(t *testing.T) {
	t.Parallel()
	s := sku("dbfail")
	restock(t, s, 10, 100)
	key := "dbfail-" + randHex()
	ctx := context.Background()
	for _, q := range []string{
		`CREATE OR REPLACE FUNCTION e2e_die() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); RETURN NEW; END $$`,
		`CREATE TRIGGER ` + strings.ReplaceAll(key, "-", "_") + ` BEFORE INSERT ON idempotency_keys FOR EACH ROW
			WHEN (NEW.key = '` + key + `') EXECUTE FUNCTION e2e_die()`,
	} {
		if _, err := shop.pools.Order.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	dropped := false
	drop := func() {
		if !dropped {
			dropped = true
			if _, err := shop.pools.Order.Exec(ctx, `DROP TRIGGER `+strings.ReplaceAll(key, "-", "_")+` ON idempotency_keys`); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Cleanup(drop)

	r := placeOrder(t, key, item(s, 1))
	if r.status != http.StatusServiceUnavailable || r.body["code"] != "dependency-unavailable" {
		t.Fatalf("POST /orders with the database failing: %d %s, want 503 dependency-unavailable", r.status, r.raw)
	}
	if secs, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || secs < 1 {
		t.Errorf("Retry-After %q, want whole seconds", r.header.Get("Retry-After"))
	}
	if detail, _ := r.body["detail"].(string); !strings.Contains(detail, "same Idempotency-Key") {
		t.Errorf("detail %q does not say to retry with the same Idempotency-Key", detail)
	}
	drop()
	first := placeOrder(t, key, item(s, 1))
	again := placeOrder(t, key, item(s, 1))
	if first.status != http.StatusCreated || again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "true" ||
		first.body["order_id"] != again.body["order_id"] {
		t.Fatalf("retries with the same key: %d %s, then %d %s", first.status, first.raw, again.status, again.raw)
	}
	var n int
	if err := shop.pools.Order.QueryRow(ctx, `SELECT count(*) FROM order_items WHERE sku = $1`, s).Scan(&n); err != nil {
		t.Fatal(err)
	}
	// The probe order of restock, and this one.
	if n != 2 {
		t.Errorf("%d orders of %s, want 2 (the probe and this one)", n, s)
	}
	checkInvariants(t)
}

// HEAD is answered wherever GET is: the GET's status and headers, no body
// (the checker validates them against the HEAD operations).
func TestHeadWhereverGet(t *testing.T) {
	t.Parallel()
	s := sku("head")
	restock(t, s, 10, 100)
	o := placeOrder(t, "head-"+randHex(), item(s, 1))
	if o.status != http.StatusCreated {
		t.Fatalf("order: %d %s", o.status, o.raw)
	}
	id := o.body["order_id"].(string)
	for _, c := range []struct {
		url  string
		want int
	}{
		{shop.order + "/healthz", 200},
		{shop.inventory + "/readyz", 200},
		{shop.payment + "/metrics", 200},
		{shop.order + "/orders/" + id, 200},
		{shop.order + "/orders/00000000-0000-0000-0000-000000000000", 404},
		{shop.inventory + "/stock/" + s, 200},
		{shop.payment + "/payments/" + id, 0}, // 200 or 404, as the payment service has heard of it or not
		{shop.fulfillment + "/shipments/" + id, 404},
	} {
		r := do(t, http.MethodHead, c.url, nil, nil)
		if r.status == http.StatusMethodNotAllowed || c.want != 0 && r.status != c.want || r.raw != "" {
			t.Errorf("HEAD %s: %d with %d bytes, want %d and no body", c.url, r.status, len(r.raw), c.want)
		}
		if get := do(t, http.MethodGet, c.url, nil, nil); c.want != 0 && get.header.Get("Content-Type") != r.header.Get("Content-Type") {
			t.Errorf("HEAD %s: Content-Type %q, GET's is %q", c.url, r.header.Get("Content-Type"), get.header.Get("Content-Type"))
		}
	}
	if r := do(t, http.MethodHead, shop.order+"/orders", nil, nil); r.status != http.StatusMethodNotAllowed {
		t.Errorf("HEAD /orders (POST only): %d, want 405", r.status)
	}
}
