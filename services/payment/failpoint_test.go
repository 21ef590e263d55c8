package payment

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/proof/poll"
)

// failFirst is a FailpointFunc that fails the first hit of name only.
func failFirst(name string, hits *atomic.Int32) func(string) error {
	return func(n string) error {
		if n == name && hits.Add(1) == 1 {
			return fmt.Errorf("failpoint %s: %w", n, failpoint.ErrInjected)
		}
		return nil
	}
}

// aborted runs fn and reports whether it dropped the response the way
// net/http does it: by panicking with http.ErrAbortHandler.
func aborted(fn func()) (dropped bool) {
	defer func() {
		if r := recover(); r != nil {
			if r != http.ErrAbortHandler {
				panic(r)
			}
			dropped = true
		}
	}()
	fn()
	return false
}

func TestFailpointWebhookAfterCommitBeforeResponse(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var hits atomic.Int32
	e.svc.hooks.FailpointFunc = failFirst(failpoint.PaymentWebhookAfterCommitBeforeResponse, &hits)
	e.start(t)
	order := e.intent(t, StatePayable, 1200)
	cb := Callback{OrderID: order, ProviderPaymentID: "pay_lost_answer", Status: StatusSucceeded, Amount: 1200}

	// The callback is recorded and the provider gets no answer.
	if !aborted(func() { e.signed(t, cb) }) {
		t.Fatal("the webhook answered through the failpoint; want the response dropped")
	}
	if n := e.count(t, `SELECT count(*) FROM payments WHERE order_id = $1`, order); n != 1 {
		t.Fatalf("%d payments after the lost answer, want the 1 committed", n)
	}

	// The provider sends it again: a harmless replay.
	rec := e.signed(t, cb)
	wantStatus(t, rec, http.StatusOK)
	if rec.Header().Get("Idempotent-Replayed") != "true" {
		t.Fatal("the provider's retry was not recognised as a replay")
	}
	if n := e.count(t, `SELECT count(*) FROM payments WHERE order_id = $1`, order); n != 1 {
		t.Fatalf("%d payments after the retry, want 1", n)
	}
	if n := len(e.outboxRows(t, EventPaymentSucceeded)); n != 1 {
		t.Fatalf("%d PaymentSucceeded events, want 1", n)
	}
}

func TestFailpointRefundAfterProviderBeforeStore(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var hits atomic.Int32
	e.svc.hooks.FailpointFunc = failFirst(failpoint.PaymentRefundAfterProviderBeforeStore, &hits)
	// A short provider call limit, so the abandoned refund's lease (twice
	// the call limit) expires within the test.
	e.svc.refundCall, e.svc.refundPoll = 200*time.Millisecond, 50*time.Millisecond
	e.start(t)
	order, paymentID := e.closedAndPaid(t, 2500)
	e.publish(t, order, "RefundRequested", map[string]any{
		"order_id": order, "payment_id": paymentID, "amount": 2500, "reason": "order_closed"})

	poll.Until(t, 30*time.Second, "the refund is DONE", func() bool { return e.refundDone(t, order) })
	if hits.Load() != 2 {
		t.Fatalf("failpoint hit %d times, want 2 (the lost outcome, the retry)", hits.Load())
	}
	if n := e.provider.Refunds(); n != 1 {
		t.Fatalf("provider made %d refunds, want 1", n)
	}
	if n := e.provider.RefundCalls(); n != 2 {
		t.Fatalf("provider was called %d times, want 2 (the same key twice)", n)
	}
	if n := e.count(t, `SELECT count(*) FROM refunds WHERE order_id = $1`, order); n != 1 {
		t.Fatalf("%d refunds recorded, want 1", n)
	}
	if n := len(e.outboxRows(t, EventPaymentRefunded)); n != 1 {
		t.Fatalf("%d PaymentRefunded events, want 1", n)
	}
}
