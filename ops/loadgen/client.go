package loadgen

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"syscall"
	"time"

	"github.com/shop-ref/shop/internal/cli"
)

// maxConnRetries bounds the retries of one order's request that got no
// answer at all (timed out, connection refused or reset, the response cut
// off): the service may be restarting, but one that stays away fails the
// order rather than keeping it spinning until -timeout.
const maxConnRetries = 8

// maxRetryWait caps the wait between two attempts, Retry-After included.
const maxRetryWait = 5 * time.Second

// create places order i, retrying what a careful client retries — a
// request that got no answer, a twin in flight (409), a shop refusing for
// now (429, 5xx) — with the same Idempotency-Key, so that a first attempt
// that did commit is answered with its order instead of making a second.
// It waits as the answer's Retry-After says, else with capped backoff.
func (g *generator) create(ctx context.Context, i int, r *orderRun) {
	key := fmt.Sprintf("loadgen-%s-%d", g.runID, i)
	body, _ := json.Marshal(map[string]any{
		"customer_id": fmt.Sprintf("loadgen-%d", i%100),
		"items":       []map[string]any{{"sku": g.cfg.skus[i%len(g.cfg.skus)], "quantity": g.cfg.quantity}},
	})
	r.createdAt = time.Now()
	backoff, wait, connErrs := 20*time.Millisecond, time.Duration(0), 0
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			g.retried.Add(1)
			select {
			case <-time.After(max(wait, backoff)):
			case <-ctx.Done():
				r.failed = fmt.Errorf("order %d: %w", i, ctx.Err())
				g.failed.Add(1)
				return
			}
			backoff = min(2*backoff, time.Second)
		}
		status, header, resp, err := g.do(ctx, http.MethodPost, g.cfg.orderURL+"/orders", key, body)
		wait = retryAfter(header)
		if err != nil {
			if ctx.Err() == nil && (isTimeout(err) || isConnError(err)) && connErrs < maxConnRetries {
				connErrs++
				continue // the same key again: the shop answers with the same order
			}
			r.failed = fmt.Errorf("order %d: POST /orders: %w", i, err)
			break
		}
		switch {
		case status == http.StatusOK || status == http.StatusCreated:
			var o struct {
				OrderID string `json:"order_id"`
				Status  string `json:"status"`
			}
			if err := json.Unmarshal(resp, &o); err != nil || o.OrderID == "" {
				r.failed = fmt.Errorf("POST /orders: %d with an unreadable order: %s", status, cli.OneLine(string(resp), 200))
				break
			}
			r.id, r.status, r.created, r.createLat = o.OrderID, o.Status, true, time.Since(r.createdAt)
			g.created.Add(1)
			return
		case status == http.StatusConflict, status == http.StatusTooManyRequests, status >= 500:
			continue // the twin is still in flight, or the service is busy
		default:
			r.failed = fmt.Errorf("POST /orders: %d %s", status, cli.OneLine(string(resp), 200))
		}
		break
	}
	g.noteErr(r.failed)
	g.failed.Add(1)
}

// follow polls order i until it settles: paid orders until COMPLETED,
// CLOSED or REJECTED (paying once it waits for payment), unpaid ones until
// they wait for payment. With -wait-complete=false it stops once paid.
func (g *generator) follow(ctx context.Context, i int, r *orderRun, sem chan struct{}) {
	defer g.settled.Add(1)
	pay := g.paid(i)
	paidAt := false
	tries := 0 // simulate calls that got no answer, or a 5xx
	interval := 25 * time.Millisecond
	for {
		switch r.status {
		case "COMPLETED":
			r.toDone = time.Since(r.createdAt)
			g.completed.Add(1)
			return
		case "CLOSED", "REJECTED":
			return
		case "WAIT_PAY":
			if !pay {
				return // stays there until the payment timeout closes it
			}
			if !paidAt {
				ok, err := g.simulate(ctx, r.id, sem, tries > 0)
				tries++
				if err != nil {
					g.noteErr(err) // the provider refused it: it stays unpaid
					return
				}
				paidAt = ok
				if ok && !g.cfg.waitComplete {
					return
				}
			}
		case "PAID", "FULFILLING":
			if !g.cfg.waitComplete {
				return
			}
		}
		select {
		case <-time.After(interval):
		case <-ctx.Done():
			return
		}
		interval = min(interval*3/2, 250*time.Millisecond)
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		status, _, resp, err := g.do(ctx, http.MethodGet, g.cfg.orderURL+"/orders/"+r.id, "", nil)
		<-sem
		if err != nil || status != http.StatusOK {
			continue
		}
		var o struct {
			Status string `json:"status"`
		}
		if json.Unmarshal(resp, &o) == nil && o.Status != "" {
			r.status = o.Status
		}
	}
}

// simulate asks the fake provider to pay, the moment the order said
// WAIT_PAY. The shop promises to take that payment, so any refusal (404,
// 409, a "rejected" payment) is counted, reported and not retried; only a
// request that got no answer, or a 5xx, is sent again on the next round.
// A 404 that is no problem+json (net/http's plain "404 page not found")
// means the route is absent: the payment service's fake provider is off.
//
// After a try that got no answer (retried), 409 already-paid means that
// try charged: it counts as the payment, not as a refusal.
func (g *generator) simulate(ctx context.Context, id string, sem chan struct{}, retried bool) (bool, error) {
	select {
	case sem <- struct{}{}:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	defer func() { <-sem }()
	status, _, resp, err := g.do(ctx, http.MethodPost, g.cfg.paymentURL+"/payments/"+id+"/simulate", "", []byte(`{"outcome":"succeeded"}`))
	var res struct {
		Status string `json:"status"`
		Code   string `json:"code"`
	}
	_ = json.Unmarshal(resp, &res)
	switch {
	case err != nil, status >= 500:
		return false, nil // try again on the next round
	case status == http.StatusOK && res.Status == "succeeded",
		retried && status == http.StatusConflict && res.Code == "already-paid":
		g.payments.Add(1)
		return true, nil
	case status == http.StatusNotFound && bytes.HasPrefix(resp, []byte("404 page not found")):
		return false, fmt.Errorf("POST /payments/%s/simulate: the payment service does not serve it: "+
			"its fake provider is off (run it with PAYMENT_FAKE_PROVIDER=true, as shop all -demo does, or use -pay 0)", id)
	}
	g.refused.Add(1)
	return false, fmt.Errorf("POST /payments/%s/simulate the moment the order said WAIT_PAY: %d %s", id, status, cli.OneLine(string(resp), 200))
}

// do sends one request and reads the whole answer.
func (g *generator) do(ctx context.Context, method, url, key string, body []byte) (int, http.Header, []byte, error) {
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
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	res, err := g.client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	if err != nil {
		return 0, nil, nil, err
	}
	return res.StatusCode, res.Header, b, nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout() || errors.Is(err, context.DeadlineExceeded)
}

// isConnError reports whether err is a request that got no answer because
// of its connection: refused (the service restarting), reset or closed
// before the response was complete (the service died mid-request). The
// request may or may not have been processed, so only an idempotent retry
// is safe.
func isConnError(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// retryAfter is the wait an answer's Retry-After header asks for (in
// seconds; the HTTP-date form is not used by the shop), capped at
// maxRetryWait; 0 without one.
func retryAfter(h http.Header) time.Duration {
	secs, err := strconv.Atoi(h.Get("Retry-After"))
	if err != nil || secs < 0 {
		return 0
	}
	return min(time.Duration(secs)*time.Second, maxRetryWait)
}
