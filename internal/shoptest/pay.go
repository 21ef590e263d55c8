package shoptest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
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

// Paid is what one customer of [Customers.PayTheInstant] saw.
type Paid struct {
	OrderID   string
	Via       string        // "webhook" or "simulate"
	WaitedFor time.Duration // from the order's creation to the GET that showed WAIT_PAY
	PayStatus int           // the payment request's HTTP status
	PayBody   string        // and its body
	Final     string        // the order's status once it ended
	History   []string      // "STATUS:reason" entries of the order's history
	Refunds   int           // refunds payment shows for the order
}

// PayTheInstant places n orders of one unit of sku at once and pays each
// the moment GET /orders/{id} shows WAIT_PAY, half through the signed
// webhook and half through simulate, then follows each to its end. It
// fails t only for what makes the report unreadable (a request that got
// no answer, an order that never ends); what the shop answered is in the
// report for the caller to judge.
func (c Customers) PayTheInstant(t testing.TB, n int, sku string) []Paid {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out := make([]Paid, n)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			via := "webhook"
			if i%2 == 1 {
				via = "simulate"
			}
			p, err := c.payOne(ctx, sku, via)
			out[i] = p
			if err != nil {
				errs <- fmt.Errorf("customer %d (%s): %w", i, via, err)
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

func (c Customers) payOne(ctx context.Context, sku, via string) (Paid, error) {
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
	var err error
	// The provider sends its webhook again after a 503 (same payment id,
	// signed anew), and a customer's simulate is retried the same way: the
	// contract marks both retryable.
	cb, _ := json.Marshal(payment.Callback{OrderID: o.OrderID, ProviderPaymentID: "pay_" + randomHex(),
		Status: payment.StatusSucceeded, Amount: o.Total})
	p.PayStatus, p.PayBody, err = c.retrying(ctx, func() (int, http.Header, []byte, error) {
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
		Refunds []json.RawMessage `json:"refunds"`
	}
	if st != http.StatusOK || json.Unmarshal([]byte(b), &view) != nil {
		return p, fmt.Errorf("GET /payments/%s: %d %s", o.OrderID, st, b)
	}
	p.Refunds = len(view.Refunds)
	return p, nil
}

// RequireAllCompleted fails t unless every customer's payment was taken at
// once (200, status succeeded), every order COMPLETED and nothing was
// refunded; it logs how long the customers waited for WAIT_PAY.
func RequireAllCompleted(t testing.TB, paid []Paid) {
	t.Helper()
	var waits []time.Duration
	for _, p := range paid {
		waits = append(waits, p.WaitedFor)
		var res struct {
			Status string `json:"status"`
		}
		_ = json.Unmarshal([]byte(p.PayBody), &res)
		switch {
		case p.PayStatus != http.StatusOK || res.Status != payment.StatusSucceeded:
			t.Errorf("order %s paid through %s the instant it showed WAIT_PAY: %d %s", p.OrderID, p.Via, p.PayStatus, strings.TrimSpace(p.PayBody))
		case p.Final != "COMPLETED" || p.Refunds != 0:
			t.Errorf("order %s paid through %s: ended %s with %d refunds; history %v", p.OrderID, p.Via, p.Final, p.Refunds, p.History)
		}
	}
	slices.Sort(waits)
	if len(waits) > 0 {
		t.Logf("%d orders paid the instant they showed WAIT_PAY; creation → WAIT_PAY p50 %v, max %v",
			len(waits), waits[len(waits)/2].Round(time.Millisecond), waits[len(waits)-1].Round(time.Millisecond))
	}
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
