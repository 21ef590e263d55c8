package shoptest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shop-ref/shop/services/payment"
)

// Customers pay orders as a customer does: they read the order through
// the order service's API and pay the moment it says WAIT_PAY, through
// the payment provider (its signed webhook) or the demo's fake provider
// (simulate). They look at nothing a customer cannot see.
type Customers struct {
	OrderURL, PaymentURL string // base URLs of the two services
	WebhookSecret        string // the provider's HMAC key (PAYMENT_WEBHOOK_SECRET)
	Client               *http.Client
}

// Paid is what one customer of [Customers.PayTheInstant] or
// [Customers.PayAround] saw.
type Paid struct {
	OrderID   string
	Via       string        // "webhook" or "simulate"
	WaitedFor time.Duration // from the order's creation to the GET that showed WAIT_PAY
	PayBy     time.Time     // the deadline the order showed
	Offset    time.Duration // when the customer meant to pay, from PayBy (PayAround)
	SentAt    time.Time     // when the payment request was sent
	PayStatus int           // the payment request's HTTP status
	PayBody   string        // and its body
	Attempts  int           // payment requests sent (503s are sent again)
	Final     string        // the order's status once it ended
	History   []string      // "STATUS:reason" entries of the order's history
	Captured  int           // payments payment shows as succeeded (applied to the order)
	Rejected  int           // payments payment shows as rejected (taken, to be refunded)
	Refunds   int           // refunds payment shows for the order
	Refunded  int           // of them, those the provider has completed
}

// Answer is what the payment request was answered: the payment's status
// for a 200 ("succeeded", "failed", "rejected"), the problem code
// otherwise. A simulate sent again after a 503 (whose outcome was unknown)
// and answered 409 already-paid was charged by the earlier try:
// "succeeded".
func (p Paid) Answer() string {
	var res struct {
		Status string `json:"status"`
		Code   string `json:"code"`
	}
	_ = json.Unmarshal([]byte(p.PayBody), &res)
	switch {
	case p.PayStatus == http.StatusOK:
		return res.Status
	case p.PayStatus == http.StatusConflict && res.Code == "already-paid" && p.Attempts > 1:
		return payment.StatusSucceeded
	}
	return fmt.Sprintf("%d %s", p.PayStatus, res.Code)
}

// PayTheInstant places n orders of one unit of sku at once and pays each
// the moment GET /orders/{id} shows WAIT_PAY, half through the signed
// webhook and half through simulate, then follows each to its end. It
// fails t only for what makes the report unreadable (a request that got
// no answer, an order that never ends); what the shop answered is in the
// report for the caller to judge.
func (c Customers) PayTheInstant(t testing.TB, n int, sku string) []Paid {
	t.Helper()
	return c.pay(t, n, sku, 2*time.Minute, func(i int) (string, *time.Duration) {
		if i%2 == 1 {
			return "simulate", nil
		}
		return "webhook", nil
	})
}

// PayAround places len(offsets)×2 orders of one unit of sku at once; each
// customer waits until GET /orders/{id} shows WAIT_PAY, reads its pay_by,
// and pays at pay_by + its offset (before, at, after the deadline), each
// offset once through the signed webhook and once through simulate, then
// follows the order to its end and reads what payment shows of it. Like
// PayTheInstant it fails t only for what makes the report unreadable.
func (c Customers) PayAround(t testing.TB, sku string, offsets []time.Duration) []Paid {
	t.Helper()
	return c.pay(t, 2*len(offsets), sku, 3*time.Minute, func(i int) (string, *time.Duration) {
		offset := offsets[i/2]
		if i%2 == 1 {
			return "simulate", &offset
		}
		return "webhook", &offset
	})
}

// pay runs n customers at once, customer i paying as plan(i) says, within
// limit, and fails t only for what makes the report unreadable.
func (c Customers) pay(t testing.TB, n int, sku string, limit time.Duration, plan func(i int) (via string, offset *time.Duration)) []Paid {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	out := make([]Paid, n)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			via, offset := plan(i)
			p, err := c.payOne(ctx, sku, via, offset)
			out[i] = p
			if err != nil {
				errs <- fmt.Errorf("customer %d (%s, offset %v): %w", i, via, p.Offset, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
	return out
}

// payOne is one customer: it places an order, waits for WAIT_PAY and pays
// through via, at once (offset nil) or at pay_by + *offset.
func (c Customers) payOne(ctx context.Context, sku, via string, offset *time.Duration) (Paid, error) {
	p := Paid{Via: via}
	key := "customer-" + randomHex()
	created := time.Now()
	var o struct {
		OrderID string `json:"order_id"`
		Status  string `json:"status"`
		Total   int64  `json:"total"`
		History []struct {
			Status string `json:"status"`
			Reason string `json:"reason"`
		} `json:"history"`
		Payment *struct {
			PayBy time.Time `json:"pay_by"`
		} `json:"payment"`
	}
	body := fmt.Sprintf(`{"customer_id":"instant","items":[{"sku":%q,"quantity":1}]}`, sku)
	for {
		// A customer retries what the shop says to retry (503 while it
		// sheds load), with the same key.
		st, h, b, err := c.send(ctx, http.MethodPost, c.OrderURL+"/orders", []byte(body), map[string]string{"Idempotency-Key": key})
		if err != nil {
			return p, fmt.Errorf("POST /orders: %w", err)
		}
		if st == http.StatusServiceUnavailable || st == http.StatusConflict {
			if err := sleep(ctx, retryAfter(h)); err != nil {
				return p, err
			}
			continue
		}
		if st != http.StatusCreated || json.Unmarshal(b, &o) != nil {
			return p, fmt.Errorf("POST /orders: %d %s", st, b)
		}
		break
	}
	p.OrderID = o.OrderID
	get := func() error {
		st, h, b, err := c.send(ctx, http.MethodGet, c.OrderURL+"/orders/"+o.OrderID, nil, nil)
		if err != nil {
			return fmt.Errorf("GET /orders/%s: %w", o.OrderID, err)
		}
		if st == http.StatusServiceUnavailable {
			// Retryable by the contract (x-retryable); the customer looks
			// again after Retry-After, as at any other poll.
			return sleep(ctx, retryAfter(h))
		}
		if st != http.StatusOK || json.Unmarshal(b, &o) != nil {
			return fmt.Errorf("GET /orders/%s: %d %s", o.OrderID, st, b)
		}
		return nil
	}
	// Watch as an impatient customer does, every 20 ms.
	for o.Status == "PENDING" {
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return p, fmt.Errorf("order %s still PENDING: %w", o.OrderID, err)
		}
		if err := get(); err != nil {
			return p, err
		}
	}
	if o.Status != "WAIT_PAY" {
		p.Final = o.Status
		return p, fmt.Errorf("order %s went PENDING → %s, never WAIT_PAY", o.OrderID, o.Status)
	}
	p.WaitedFor = time.Since(created)
	if o.Payment == nil {
		return p, fmt.Errorf("order %s shows WAIT_PAY without what to pay", o.OrderID)
	}
	p.PayBy = o.Payment.PayBy
	if offset != nil {
		p.Offset = *offset
		if err := sleep(ctx, time.Until(p.PayBy.Add(*offset))); err != nil {
			return p, err
		}
	}
	p.SentAt = time.Now()
	var err error
	// The provider sends its webhook again after a 503 (same payment id,
	// signed anew), and a customer's simulate is retried the same way: the
	// contract marks both retryable.
	cb, _ := json.Marshal(payment.Callback{OrderID: o.OrderID, ProviderPaymentID: "pay_" + randomHex(),
		Status: payment.StatusSucceeded, Amount: o.Total})
	p.PayStatus, p.PayBody, err = c.retrying(ctx, func() (int, http.Header, []byte, error) {
		p.Attempts++
		if via == "webhook" {
			return c.send(ctx, http.MethodPost, c.PaymentURL+"/webhooks/payment", cb,
				map[string]string{payment.SignatureHeader: payment.Sign(c.WebhookSecret, time.Now(), cb)})
		}
		return c.send(ctx, http.MethodPost, c.PaymentURL+"/payments/"+o.OrderID+"/simulate",
			[]byte(`{"outcome":"succeeded"}`), nil)
	})
	if err != nil {
		return p, fmt.Errorf("pay order %s: %w", o.OrderID, err)
	}
	for !slices.Contains([]string{"COMPLETED", "CLOSED", "REJECTED"}, o.Status) {
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return p, fmt.Errorf("order %s did not end (still %s): %w", o.OrderID, o.Status, err)
		}
		if err := get(); err != nil {
			return p, err
		}
	}
	p.Final = o.Status
	for _, h := range o.History {
		p.History = append(p.History, h.Status+":"+h.Reason)
	}
	st, b, err := c.retrying(ctx, func() (int, http.Header, []byte, error) {
		return c.send(ctx, http.MethodGet, c.PaymentURL+"/payments/"+o.OrderID, nil, nil)
	})
	if err != nil {
		return p, fmt.Errorf("GET /payments/%s: %w", o.OrderID, err)
	}
	var view struct {
		Payments []struct {
			Status string `json:"status"`
		} `json:"payments"`
		Refunds []struct {
			State string `json:"state"`
		} `json:"refunds"`
	}
	if st != http.StatusOK || json.Unmarshal([]byte(b), &view) != nil {
		return p, fmt.Errorf("GET /payments/%s: %d %s", o.OrderID, st, b)
	}
	for _, pm := range view.Payments {
		switch pm.Status {
		case payment.StatusSucceeded:
			p.Captured++
		case payment.StatusRejected:
			p.Rejected++
		}
	}
	p.Refunds = len(view.Refunds)
	for _, r := range view.Refunds {
		if r.State == "DONE" {
			p.Refunded++
		}
	}
	return p, nil
}

// RequireAllCompleted fails t unless every customer's payment was taken at
// once (200, status succeeded), every order COMPLETED and nothing was
// refunded; it logs how long the customers waited for WAIT_PAY. A customer
// who could only read WAIT_PAY after its pay_by had passed (the order
// service answered that late) was not promised the payment: refused, the
// order must end CLOSED with nothing captured.
func RequireAllCompleted(t testing.TB, paid []Paid) {
	t.Helper()
	var waits []time.Duration
	late := 0
	for _, p := range paid {
		waits = append(waits, p.WaitedFor)
		switch {
		case !p.SentAt.Before(p.PayBy) && p.Answer() == "409 payment-window-closed":
			late++
			if p.Final != "CLOSED" || p.Captured != 0 {
				t.Errorf("order %s, paid through %s after the pay_by it showed, was refused and ended %s with %d payments captured",
					p.OrderID, p.Via, p.Final, p.Captured)
			}
		case p.Answer() != payment.StatusSucceeded:
			t.Errorf("order %s paid through %s the instant it showed WAIT_PAY: %d %s", p.OrderID, p.Via, p.PayStatus, strings.TrimSpace(p.PayBody))
		case p.Final != "COMPLETED" || p.Refunds != 0:
			t.Errorf("order %s paid through %s: ended %s with %d refunds; history %v", p.OrderID, p.Via, p.Final, p.Refunds, p.History)
		}
	}
	slices.Sort(waits)
	if len(waits) > 0 {
		t.Logf("%d orders paid the instant they showed WAIT_PAY (%d of them only after their pay_by); creation → WAIT_PAY p50 %v, max %v",
			len(waits), late, waits[len(waits)/2].Round(time.Millisecond), waits[len(waits)-1].Round(time.Millisecond))
	}
}

// RequireAnswerIsOutcome fails t unless what each customer of PayAround
// was answered is what happened: "succeeded" ⇒ COMPLETED, one payment
// captured, nothing refunded; refused by simulate (409, not retryable) ⇒
// CLOSED and nothing captured; "rejected" by the webhook (the provider
// took the money after the deadline) ⇒ CLOSED, nothing captured, the
// money refunded once. It logs the outcomes per offset.
func RequireAnswerIsOutcome(t testing.TB, paid []Paid) {
	t.Helper()
	type tally struct{ succeeded, refused int }
	perOffset := map[time.Duration]*tally{}
	for _, p := range paid {
		if perOffset[p.Offset] == nil {
			perOffset[p.Offset] = &tally{}
		}
		closed := p.Final == "CLOSED" && p.Captured == 0
		switch answer := p.Answer(); {
		case answer == payment.StatusSucceeded:
			perOffset[p.Offset].succeeded++
			if p.Final != "COMPLETED" || p.Captured != 1 || p.Refunds != 0 {
				t.Errorf("order %s, paid through %s at pay_by%+v (sent %+v), was answered succeeded and ended %s with %d payments captured and %d refunds; history %v",
					p.OrderID, p.Via, p.Offset, p.SentAt.Sub(p.PayBy).Round(time.Millisecond), p.Final, p.Captured, p.Refunds, p.History)
			}
		case p.Via == "simulate" && p.PayStatus == http.StatusConflict:
			perOffset[p.Offset].refused++
			if !closed || p.Rejected != 0 {
				t.Errorf("order %s, simulate at pay_by%+v refused (%s), ended %s with %d captured and %d rejected payments: want CLOSED and nothing taken; history %v",
					p.OrderID, p.Offset, answer, p.Final, p.Captured, p.Rejected, p.History)
			}
		case p.Via == "webhook" && answer == payment.StatusRejected:
			perOffset[p.Offset].refused++
			if !closed || p.Rejected != 1 || p.Refunds != 1 {
				t.Errorf("order %s, webhook at pay_by%+v answered rejected, ended %s with %d captured, %d rejected payments and %d refunds: want CLOSED and one refund; history %v",
					p.OrderID, p.Offset, p.Final, p.Captured, p.Rejected, p.Refunds, p.History)
			}
		default:
			t.Errorf("order %s, paid through %s at pay_by%+v: answered %d %s", p.OrderID, p.Via, p.Offset, p.PayStatus, strings.TrimSpace(p.PayBody))
		}
	}
	offsets := slices.Sorted(maps.Keys(perOffset))
	var line strings.Builder
	for _, o := range offsets {
		fmt.Fprintf(&line, " %+v: %d succeeded, %d refused;", o, perOffset[o].succeeded, perOffset[o].refused)
	}
	t.Logf("%d orders paid around their pay_by, per offset:%s", len(paid), strings.TrimSuffix(line.String(), ";"))
}

func (c Customers) send(ctx context.Context, method, url string, body []byte, header map[string]string) (int, http.Header, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	client := c.Client
	if client == nil {
		client = http.DefaultClient
	}
	res, err := client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, b, err
}

// retrying sends until the answer is not a 503 (the shop shedding load or
// its database not answering, retryable by the contract), waiting the
// Retry-After each asks for, and returns the last answer.
func (c Customers) retrying(ctx context.Context, send func() (int, http.Header, []byte, error)) (int, string, error) {
	for {
		st, h, b, err := send()
		if err != nil || st != http.StatusServiceUnavailable {
			return st, string(b), err
		}
		if err := sleep(ctx, retryAfter(h)); err != nil {
			return st, string(b), err
		}
	}
}

// retryAfter is the wait an answer's Retry-After asks for, 1 s without one.
func retryAfter(h http.Header) time.Duration {
	var secs int
	if _, err := fmt.Sscan(h.Get("Retry-After"), &secs); err != nil || secs <= 0 {
		return time.Second
	}
	return time.Duration(secs) * time.Second
}

func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

func randomHex() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
