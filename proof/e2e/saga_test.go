package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/proof/poll"
)

// The tests run one after the other: each ends by waiting until the whole
// shop is quiet and checking every invariant, which traffic from a parallel
// test would keep from settling.

func TestHappyPathToCompleted(t *testing.T) {
	s := sku("happy")
	restock(t, s, 10, 1999)
	r := placeOrder(t, "happy-"+randHex(), item(s, 2))
	if r.status != http.StatusCreated || r.body["status"] != "PENDING" || r.body["total"] != float64(3998) {
		t.Fatalf("place order: %d %s", r.status, r.raw)
	}
	id := r.body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")
	if pay := do(t, "POST", shop.payment+"/payments/"+id+"/simulate", nil, map[string]string{"outcome": "succeeded"}); pay.status != http.StatusOK {
		t.Fatalf("simulate payment: %d %s", pay.status, pay.raw)
	}
	waitStatus(t, id, "COMPLETED")

	got := do(t, "GET", shop.order+"/orders/"+id, nil, nil)
	var states []string
	for _, h := range got.body["history"].([]any) {
		states = append(states, h.(map[string]any)["status"].(string))
	}
	if strings.Join(states, ">") != "PENDING>WAIT_PAY>PAID>FULFILLING>COMPLETED" {
		t.Fatalf("history = %v", states)
	}
	checkInvariants(t)
	if onHand, reserved, sold := stock(t, s); onHand != 8 || reserved != 0 || sold != 2 {
		t.Fatalf("stock after sale: on_hand %d reserved %d sold %d, want 8 0 2", onHand, reserved, sold)
	}
	// docs/architecture.md ("Backpressure") counts the deliveries an order
	// starts: every consumer's processed row of every event about it.
	var ids []string
	for _, pool := range []*pgxpool.Pool{shop.pools.Order, shop.pools.Inventory, shop.pools.Payment, shop.pools.Fulfillment} {
		rows, _ := pool.Query(t.Context(), `SELECT event_id::text FROM outbox WHERE aggregate_id = $1`, id)
		more, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, more...)
	}
	deliveries := 0
	for _, pool := range []*pgxpool.Pool{shop.pools.Order, shop.pools.Inventory, shop.pools.Payment, shop.pools.Fulfillment} {
		var n int
		if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM processed_events WHERE event_id::text = ANY($1)`, ids).Scan(&n); err != nil {
			t.Fatal(err)
		}
		deliveries += n
	}
	if len(ids) != 10 || deliveries != 15 {
		t.Errorf("a completed order made %d events and %d deliveries; docs/architecture.md says 10 and 15", len(ids), deliveries)
	}
}

func TestOutOfStockIsRejectedAndHoldsNothing(t *testing.T) {
	s := sku("scarce")
	restock(t, s, 1, 500)
	r := placeOrder(t, "scarce-"+randHex(), item(s, 2))
	if r.status != http.StatusCreated {
		t.Fatalf("place order: %d %s", r.status, r.raw)
	}
	waitStatus(t, r.body["order_id"].(string), "REJECTED")
	checkInvariants(t)
	if _, reserved, _ := stock(t, s); reserved != 0 {
		t.Fatalf("a rejected order holds %d units", reserved)
	}
}

func TestPaymentFailureClosesAndReleases(t *testing.T) {
	s := sku("fail")
	restock(t, s, 5, 700)
	id := placeOrder(t, "fail-"+randHex(), item(s, 3)).body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")
	if _, reserved, _ := stock(t, s); reserved != 3 {
		t.Fatalf("WAIT_PAY holds %d units, want 3", reserved)
	}
	if pay := do(t, "POST", shop.payment+"/payments/"+id+"/simulate", nil, map[string]string{"outcome": "failed"}); pay.status != http.StatusOK {
		t.Fatalf("simulate a failed payment: %d %s", pay.status, pay.raw)
	}
	waitStatus(t, id, "CLOSED")
	checkInvariants(t)
	if _, reserved, _ := stock(t, s); reserved != 0 {
		t.Fatalf("a closed order holds %d units", reserved)
	}
}

func TestPaymentTimeoutClosesAndReleases(t *testing.T) {
	s := sku("slow")
	restock(t, s, 5, 700)
	id := placeOrder(t, "slow-"+randHex(), item(s, 1)).body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")
	poll.Until(t, paymentTimeout+captureGrace+15*time.Second, "payment expires the intent and the order closes", func() bool {
		return orderStatus(t, id) == "CLOSED"
	})
	checkInvariants(t)
	if _, reserved, _ := stock(t, s); reserved != 0 {
		t.Fatalf("a timed-out order holds %d units", reserved)
	}
}

func TestCustomerCancel(t *testing.T) {
	s := sku("cancel")
	restock(t, s, 5, 700)
	id := placeOrder(t, "cancel-"+randHex(), item(s, 1)).body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")
	if r := do(t, "POST", shop.order+"/orders/"+id+"/cancel", nil, nil); r.status != http.StatusAccepted {
		t.Fatalf("cancel: %d %s", r.status, r.raw)
	}
	waitStatus(t, id, "CLOSED")
	if r := do(t, "POST", shop.order+"/orders/"+id+"/cancel", nil, nil); r.status != http.StatusConflict {
		t.Fatalf("cancel a closed order: %d, want 409", r.status)
	}
	checkInvariants(t)
}

func TestLatePaymentIsRefundedOnce(t *testing.T) {
	s := sku("late")
	restock(t, s, 5, 1250)
	r := placeOrder(t, "late-"+randHex(), item(s, 2))
	id := r.body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")
	do(t, "POST", shop.order+"/orders/"+id+"/cancel", nil, nil)
	waitStatus(t, id, "CLOSED")

	// The customer's money arrives after all; the provider calls twice.
	provider := "psp-" + randHex()
	for range 2 {
		if w := webhook(t, id, provider, "succeeded", 2500); w.status != http.StatusOK {
			t.Fatalf("late webhook: %d %s", w.status, w.raw)
		}
	}
	// Payment rejects it once it has read the close (or, before that, the
	// saga asks for it back): either way the money goes back once.
	poll.Until(t, 20*time.Second, "payment shows the money refunded", func() bool {
		var view struct {
			Refunds []struct {
				State string `json:"state"`
			} `json:"refunds"`
		}
		r := do(t, "GET", shop.payment+"/payments/"+id, nil, nil)
		return json.Unmarshal([]byte(r.raw), &view) == nil && len(view.Refunds) == 1 && view.Refunds[0].State == "DONE"
	})
	checkInvariants(t) // includes: every closed-but-paid order has exactly one refund, every rejected payment is refunded
	if got := orderStatus(t, id); got != "CLOSED" {
		t.Fatalf("a refunded order is %s, want CLOSED", got)
	}
}

func TestIdempotencyKeys(t *testing.T) {
	s := sku("idem")
	restock(t, s, 100, 300)

	t.Run("replay returns the same order", func(t *testing.T) {
		key := "replay-" + randHex()
		first := placeOrder(t, key, item(s, 1))
		again := placeOrder(t, key, item(s, 1))
		if first.status != http.StatusCreated || (again.status != http.StatusOK && again.status != http.StatusCreated) {
			t.Fatalf("statuses %d, %d", first.status, again.status)
		}
		if again.header.Get("Idempotent-Replayed") != "true" || again.body["order_id"] != first.body["order_id"] {
			t.Fatalf("replay: header %q, order %v vs %v", again.header.Get("Idempotent-Replayed"), again.body["order_id"], first.body["order_id"])
		}
	})
	t.Run("the same key with another body is 422", func(t *testing.T) {
		key := "other-" + randHex()
		placeOrder(t, key, item(s, 1))
		if r := placeOrder(t, key, item(s, 2)); r.status != http.StatusUnprocessableEntity {
			t.Fatalf("status %d, want 422", r.status)
		}
	})
	t.Run("concurrent twins create one order", func(t *testing.T) {
		key := "twins-" + randHex()
		var mu sync.Mutex
		ids := map[any]bool{}
		var wg sync.WaitGroup
		for range 20 {
			wg.Go(func() {
				r := placeOrder(t, key, item(s, 1))
				mu.Lock()
				defer mu.Unlock()
				switch r.status {
				case http.StatusCreated, http.StatusOK:
					ids[r.body["order_id"]] = true
				case http.StatusConflict: // the twin is still in flight
				default:
					t.Errorf("twin: %d %s", r.status, r.raw)
				}
			})
		}
		wg.Wait()
		if len(ids) != 1 {
			t.Fatalf("%d different orders for one key", len(ids))
		}
	})
	t.Run("a missing, empty or overlong key is 400", func(t *testing.T) {
		for _, key := range []string{"", strings.Repeat("k", 256)} {
			r := do(t, "POST", shop.order+"/orders", map[string]string{"Idempotency-Key": key},
				map[string]any{"customer_id": "c-1", "items": []any{item(s, 1)}})
			if r.status != http.StatusBadRequest {
				t.Errorf("key %.10q…: status %d, want 400", key, r.status)
			}
		}
	})
	checkInvariants(t)
}

func TestConcurrentOrdersNeverOversell(t *testing.T) {
	s := sku("rush")
	restock(t, s, 20, 100)
	var wg sync.WaitGroup
	ids := make(chan string, 200)
	for i := range 200 {
		wg.Go(func() {
			r := placeOrder(t, fmt.Sprintf("rush-%d-%s", i, randHex()), item(s, 1))
			if r.status != http.StatusCreated {
				t.Errorf("order %d: %d %s", i, r.status, r.raw)
				return
			}
			ids <- r.body["order_id"].(string)
		})
	}
	wg.Wait()
	close(ids)
	waiting, rejected := 0, 0
	for id := range ids {
		poll.Until(t, 30*time.Second, "order "+id+" decided", func() bool {
			st := orderStatus(t, id)
			return st != "PENDING"
		})
		switch orderStatus(t, id) {
		case "WAIT_PAY", "CLOSED": // CLOSED: its payment timed out already
			waiting++
		case "REJECTED":
			rejected++
		}
	}
	if waiting != 20 || rejected != 180 {
		t.Fatalf("%d orders got stock and %d were rejected; want 20 and 180", waiting, rejected)
	}
	checkInvariants(t)
}

func TestBadInputWritesNothing(t *testing.T) {
	s := sku("strict")
	restock(t, s, 10, 100)
	// Only what these requests could write: orders of SKU s, their events
	// and the "bad-" keys. Orders of earlier tests still move on (their
	// payment timeouts fire) and write events of their own meanwhile.
	count := func() (n int) {
		err := shop.pools.Order.QueryRow(context.Background(), `
			SELECT (SELECT count(*) FROM order_items WHERE sku = $1)
			     + (SELECT count(*) FROM outbox WHERE aggregate_id IN (SELECT order_id::text FROM order_items WHERE sku = $1))
			     + (SELECT count(*) FROM idempotency_keys WHERE key LIKE 'bad-%')`, s).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	checkInvariants(t) // quiet first, so counts only move because of us
	before := count()
	cases := []struct {
		name        string
		contentType string
		body        string
		want        int
	}{
		{"bad JSON", "application/json", `{"customer_id": "c-1", "items": [`, http.StatusBadRequest},
		{"unknown field", "application/json", `{"customer_id":"c-1","items":[{"sku":"` + s + `","quantity":1}],"coupon":"FREE"}`, http.StatusBadRequest},
		{"wrong type", "application/json", `{"customer_id":"c-1","items":[{"sku":"` + s + `","quantity":"one"}]}`, http.StatusBadRequest},
		{"unknown SKU", "application/json", `{"customer_id":"c-1","items":[{"sku":"NO-SUCH-SKU","quantity":1}]}`, http.StatusUnprocessableEntity},
		{"quantity 0", "application/json", `{"customer_id":"c-1","items":[{"sku":"` + s + `","quantity":0}]}`, http.StatusUnprocessableEntity},
		{"negative quantity", "application/json", `{"customer_id":"c-1","items":[{"sku":"` + s + `","quantity":-1}]}`, http.StatusUnprocessableEntity},
		{"absurd quantity", "application/json", `{"customer_id":"c-1","items":[{"sku":"` + s + `","quantity":100000000000}]}`, http.StatusUnprocessableEntity},
		{"no items", "application/json", `{"customer_id":"c-1","items":[]}`, http.StatusUnprocessableEntity},
		{"bad SKU syntax", "application/json", `{"customer_id":"c-1","items":[{"sku":"a b","quantity":1}]}`, http.StatusUnprocessableEntity},
		{"1 MB body", "application/json", `{"customer_id":"` + strings.Repeat("x", 1<<20) + `","items":[]}`, http.StatusRequestEntityTooLarge},
		{"wrong content type", "text/plain", `{"customer_id":"c-1","items":[{"sku":"` + s + `","quantity":1}]}`, http.StatusUnsupportedMediaType},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, _ := http.NewRequest("POST", shop.order+"/orders", strings.NewReader(c.body))
			req.Header.Set("Content-Type", c.contentType)
			req.Header.Set("Idempotency-Key", "bad-"+randHex())
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			res.Body.Close()
			if res.StatusCode != c.want {
				t.Errorf("status %d, want %d", res.StatusCode, c.want)
			}
			if ct := res.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/problem+json") {
				t.Errorf("content type %q, want application/problem+json", ct)
			}
		})
	}
	if after := count(); after != before {
		t.Fatalf("refused requests wrote %d rows", after-before)
	}
	checkInvariants(t)
}
