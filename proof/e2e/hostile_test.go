package e2e

import (
	"net/http"
	"strings"
	"testing"

	"github.com/google/uuid"
)

// With OPERATOR_TOKEN set, PUT /stock/{sku} refuses a missing or wrong
// bearer token with 401 and its challenge, and writes nothing.
func TestOperatorEndpointNeedsTheToken(t *testing.T) {
	s := sku("guarded")
	for name, header := range map[string]map[string]string{
		"no token":    nil,
		"wrong token": {"Authorization": "Bearer not-" + operatorToken},
		"not bearer":  {"Authorization": "Basic " + operatorToken},
	} {
		r := do(t, "PUT", shop.inventory+"/stock/"+s, header, map[string]int{"on_hand": 5, "price": 100})
		if r.status != http.StatusUnauthorized || r.header.Get("Content-Type") != "application/problem+json" ||
			!strings.HasPrefix(r.header.Get("WWW-Authenticate"), "Bearer") || r.body["code"] != "unauthorized" {
			t.Errorf("%s: %d %q %q %s", name, r.status, r.header.Get("Content-Type"), r.header.Get("WWW-Authenticate"), r.raw)
		}
	}
	if r := do(t, "GET", shop.inventory+"/stock/"+s, nil, nil); r.status != http.StatusNotFound {
		t.Fatalf("a refused restock wrote stock: %d %s", r.status, r.raw)
	}
	restock(t, s, 5, 100) // with the token
	if on, _, _ := stock(t, s); on != 5 {
		t.Fatalf("on_hand %d after the restock, want 5", on)
	}
	checkInvariants(t)
}

// Money the provider took that the order cannot take (another amount, an
// order no one knows) is recorded, answered 200 and refunded once, however
// often the provider calls; the order still takes its right payment.
func TestUnappliedPaymentsAreRefunded(t *testing.T) {
	s := sku("unapplied")
	restock(t, s, 5, 1000)
	r := placeOrder(t, "unapplied-"+randHex(), item(s, 1))
	id := r.body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")

	short, stray := "psp-short-"+randHex(), "psp-stray-"+randHex()
	unknown := uuid.NewString()
	for range 2 { // the provider calls twice
		if w := webhook(t, id, short, "succeeded", 999); w.status != http.StatusOK || w.body["status"] != "rejected" || w.body["reason"] != "amount_mismatch" {
			t.Fatalf("short payment: %d %s", w.status, w.raw)
		}
		if w := webhook(t, unknown, stray, "succeeded", 4200); w.status != http.StatusOK || w.body["status"] != "rejected" || w.body["reason"] != "unknown_order" {
			t.Fatalf("payment for an unknown order: %d %s", w.status, w.raw)
		}
	}
	if got := orderStatus(t, id); got != "WAIT_PAY" {
		t.Fatalf("after a rejected payment the order is %s, want WAIT_PAY", got)
	}
	if w := webhook(t, id, "psp-right-"+randHex(), "succeeded", 1000); w.status != http.StatusOK || w.body["status"] != "succeeded" {
		t.Fatalf("the right payment: %d %s", w.status, w.raw)
	}
	waitStatus(t, id, "COMPLETED")
	checkInvariants(t) // waits until every rejected payment is refunded
	for _, p := range []string{short, stray} {
		var n int
		err := shop.pools.Payment.QueryRow(t.Context(), `SELECT count(*) FROM refunds f JOIN payments p USING (payment_id)
			WHERE p.provider_payment_id = $1 AND p.status = 'rejected' AND f.state = 'DONE'`, p).Scan(&n)
		if err != nil || n != 1 {
			t.Errorf("rejected payment %s: %d refunds done (%v), want 1", p, n, err)
		}
	}
}
