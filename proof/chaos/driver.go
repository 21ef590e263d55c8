package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"
)

// The driver's scenarios, by order number modulo 10.
const (
	scPay     = "paid"                  // 6 in 10: paid through /simulate
	scCancel  = "cancelled"             // 1 in 10: cancelled by the customer
	scTimeout = "left unpaid (timeout)" // 2 in 10: the saga's payment timeout closes it
	scLate    = "cancelled, paid late"  // 1 in 10: money arrives after the cancel: refunded
	maxInFlig = 12                      // orders the driver follows at once
	runPrefix = "chaos"                 // idempotency keys: chaos-<run>-<i>
	backoffMx = time.Second             // retry backoff cap
	pollEvery = 150 * time.Millisecond  // order status polling
	createMax = 200 * time.Millisecond  // first retry backoff of a create
)

func scenarioOf(i int) string {
	switch i % 10 {
	case 6:
		return scCancel
	case 7, 8:
		return scTimeout
	case 9:
		return scLate
	}
	return scPay
}

type orderRec struct {
	i        int
	scenario string
	key      string
	id       string
	total    int64
	err      string
}

// driver sends orders through the public API like a careful client: every
// failed or timed-out request is retried with the same Idempotency-Key.
type driver struct {
	h        *harness
	deadline time.Time // no request after this
	run      string

	mu          sync.Mutex
	orders      []*orderRec
	refusedPays []string // payments refused the moment their order said WAIT_PAY: "order: answer"
}

func (d *driver) start(chaosCtx, ctx context.Context) {
	d.run = randHex()
	sem := make(chan struct{}, maxInFlig)
	tick := time.NewTicker(time.Duration(float64(time.Second) / d.h.cfg.Rate))
	defer tick.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for i := 0; ; i++ {
		select {
		case <-chaosCtx.Done():
			return
		case <-tick.C:
		}
		select {
		case <-chaosCtx.Done():
			return
		case sem <- struct{}{}:
		}
		r := &orderRec{i: i, scenario: scenarioOf(i), key: fmt.Sprintf("%s-%s-%d", runPrefix, d.run, i)}
		d.mu.Lock()
		d.orders = append(d.orders, r)
		d.mu.Unlock()
		wg.Go(func() {
			defer func() { <-sem }()
			octx, cancel := context.WithDeadline(ctx, d.deadline)
			defer cancel()
			d.one(octx, r)
		})
	}
}

func (d *driver) one(ctx context.Context, r *orderRec) {
	if !d.create(ctx, r) {
		return
	}
	switch r.scenario {
	case scPay:
		if d.waitFor(ctx, r, "WAIT_PAY") == "WAIT_PAY" {
			d.pay(ctx, r)
		}
	case scCancel:
		d.cancel(ctx, r)
	case scLate:
		d.cancel(ctx, r)
		if d.waitFor(ctx, r, "CLOSED") == "CLOSED" {
			d.latePay(ctx, r)
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

// create places the order, round-robin over the order copies, retrying
// with the same key on errors, timeouts, 409 (twin in flight), 429 and 5xx.
func (d *driver) create(ctx context.Context, r *orderRec) bool {
	sku := []string{"CHAOS-A", "CHAOS-B"}[r.i%2]
	body := fmt.Appendf(nil, `{"customer_id":"chaos-%d","items":[{"sku":%q,"quantity":%d}]}`, r.i%50, sku, 1+r.i%3)
	urls := d.h.urls("order")
	backoff := createMax
	for attempt := 0; ; attempt++ {
		st, b, err := d.h.do(ctx, http.MethodPost, urls[(r.i+attempt)%len(urls)]+"/orders", r.key, nil, body)
		switch {
		case err == nil && (st == http.StatusCreated || st == http.StatusOK):
			var o struct {
				OrderID string `json:"order_id"`
				Total   int64  `json:"total"`
			}
			if json.Unmarshal(b, &o) != nil || o.OrderID == "" {
				r.err = fmt.Sprintf("POST /orders %d: %s", st, b)
				return false
			}
			r.id, r.total = o.OrderID, o.Total
			return true
		case err == nil && st != http.StatusConflict && st != http.StatusTooManyRequests && st < 500:
			r.err = fmt.Sprintf("POST /orders %d: %s", st, b)
			return false
		}
		if !sleepCtx(ctx, backoff) {
			r.err = fmt.Sprintf("POST /orders: gave up at the deadline (last: %d %v)", st, err)
			return false
		}
		backoff = min(2*backoff, backoffMx)
	}
}

// payBy reads the deadline the order shows (zero if it cannot).
func (d *driver) payBy(ctx context.Context, r *orderRec) time.Time {
	urls := d.h.urls("order")
	st, b, err := d.h.do(ctx, http.MethodGet, urls[r.i%len(urls)]+"/orders/"+r.id, "", nil, nil)
	if err != nil || st != http.StatusOK {
		return time.Time{}
	}
	var o struct {
		Payment struct {
			PayBy time.Time `json:"pay_by"`
		} `json:"payment"`
	}
	_ = json.Unmarshal(b, &o)
	return o.Payment.PayBy
}

// status reads the order's status from any order copy ("" on failure).
func (d *driver) status(ctx context.Context, r *orderRec, k int) string {
	urls := d.h.urls("order")
	st, b, err := d.h.do(ctx, http.MethodGet, urls[k%len(urls)]+"/orders/"+r.id, "", nil, nil)
	if err != nil || st != http.StatusOK {
		return ""
	}
	var o struct {
		Status string `json:"status"`
	}
	_ = json.Unmarshal(b, &o)
	return o.Status
}

// waitFor polls until the order reaches want or a final status.
func (d *driver) waitFor(ctx context.Context, r *orderRec, want string) string {
	for k := 0; ; k++ {
		s := d.status(ctx, r, k)
		if s == want || s == "COMPLETED" || s == "CLOSED" || s == "REJECTED" {
			return s
		}
		if !sleepCtx(ctx, pollEvery) {
			return s
		}
	}
}

// pay asks the fake provider to charge the moment the order said WAIT_PAY,
// retrying what got no answer or a 5xx, until the order shows it is paid
// or has ended. The shop promises to take that payment: any other answer
// is a refusal, recorded (the run fails on it), and not retried. Two 409s
// are the promise kept, not a refusal: already-paid on a retry (a lost
// answer had charged), and payment-window-closed for a charge sent after
// the pay_by the order showed (retries under faults can take that long).
func (d *driver) pay(ctx context.Context, r *orderRec) {
	urls := d.h.urls("payment")
	for k := 0; ; k++ {
		sent := time.Now()
		st, b, err := d.h.do(ctx, http.MethodPost, urls[(r.i+k)%len(urls)]+"/payments/"+r.id+"/simulate", "", nil, []byte(`{"outcome":"succeeded"}`))
		if err == nil && (st == http.StatusOK || st == http.StatusAccepted) {
			return
		}
		if err == nil && st == http.StatusConflict {
			var p struct {
				Code string `json:"code"`
			}
			_ = json.Unmarshal(b, &p)
			if p.Code == "already-paid" && k > 0 {
				return
			}
			if payBy := d.payBy(ctx, r); p.Code == "payment-window-closed" && !payBy.IsZero() && !sent.Before(payBy) {
				return
			}
		}
		if err == nil && st < 500 {
			d.mu.Lock()
			d.refusedPays = append(d.refusedPays, fmt.Sprintf("%s: %d %s", r.id, st, b))
			d.mu.Unlock()
			return
		}
		// A lost answer may have paid: look before charging again.
		switch d.status(ctx, r, k) {
		case "PAID", "FULFILLING", "COMPLETED", "CLOSED", "REJECTED":
			return
		}
		if !sleepCtx(ctx, pollEvery) {
			return
		}
	}
}

func (d *driver) cancel(ctx context.Context, r *orderRec) {
	urls := d.h.urls("order")
	for k := 0; ; k++ {
		st, _, err := d.h.do(ctx, http.MethodPost, urls[(r.i+k)%len(urls)]+"/orders/"+r.id+"/cancel", "", nil, nil)
		if err == nil && (st == http.StatusAccepted || st == http.StatusConflict || st == http.StatusOK) {
			return
		}
		if err == nil && st < 500 && st != http.StatusNotFound {
			r.err = fmt.Sprintf("cancel: %d", st)
			return
		}
		if !sleepCtx(ctx, pollEvery) {
			return
		}
	}
}

// latePay sends a signed provider callback for a closed order; a retry is
// a replay (same provider payment id).
func (d *driver) latePay(ctx context.Context, r *orderRec) {
	urls := d.h.urls("payment")
	for k := 0; ; k++ {
		st, err := d.h.webhook(ctx, urls[(r.i+k)%len(urls)], r.id, "late-"+r.key, r.total)
		if err == nil && st == http.StatusOK {
			return
		}
		if !sleepCtx(ctx, pollEvery) {
			return
		}
	}
}

func (d *driver) created() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, r := range d.orders {
		if r.id != "" {
			n++
		}
	}
	return n
}

// results groups the orders by scenario and final status (read from the
// order schema).
func (d *driver) results(ctx context.Context) []ScenarioResult {
	d.mu.Lock()
	orders := append([]*orderRec(nil), d.orders...)
	d.mu.Unlock()
	status := map[string]string{}
	rows, err := d.h.admin.Query(ctx, `SELECT order_id::text, status FROM `+
		d.h.schema("order")+`.orders`)
	if err == nil {
		for rows.Next() {
			var id, s string
			if rows.Scan(&id, &s) == nil {
				status[id] = s
			}
		}
		rows.Close()
	}
	var out []ScenarioResult
	for _, name := range []string{scPay, scCancel, scTimeout, scLate} {
		sr := ScenarioResult{Name: name, Final: map[string]int{}}
		for _, r := range orders {
			if r.scenario != name {
				continue
			}
			sr.Orders++
			switch {
			case r.id == "":
				sr.Final["(not created: "+r.err+")"]++
			default:
				sr.Final[status[r.id]]++
			}
		}
		out = append(out, sr)
	}
	return out
}
