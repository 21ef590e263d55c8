package payment

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/proof/poll"
)

// closedAndPaid makes an order that payment learned from ORDERS events, a
// payment that succeeded while its intent was open, and the order's close
// that crossed it (the customer cancelled as the payment was made, so the
// saga asks for the money back). It returns the order id and the payment
// id, which a RefundRequested names.
func (e *env) closedAndPaid(t *testing.T, amount int64) (string, string) {
	t.Helper()
	order := uuid.NewString()
	e.publish(t, order, "OrderCreated", map[string]any{"order_id": order, "total": amount})
	poll.Until(t, 30*time.Second, "the intent is PAYABLE", func() bool { return e.intentState(t, order) == StatePayable })
	rec := e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_" + uuid.NewString(), Status: StatusSucceeded, Amount: amount})
	wantStatus(t, rec, http.StatusOK)
	paymentID, status := decodeResult(t, rec.Body.Bytes())
	if status != StatusSucceeded {
		t.Fatalf("payment %s, want succeeded", status)
	}
	e.publish(t, order, "OrderClosed", map[string]any{"order_id": order, "reason": "customer_cancel"})
	return order, paymentID
}

func (e *env) refundDone(t *testing.T, order string) bool {
	t.Helper()
	return e.count(t, `SELECT count(*) FROM refunds WHERE order_id = $1 AND state = 'DONE'`, order) == 1
}

func TestRefundExactlyOnceAfterAmbiguousTimeout(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order, paymentID := e.closedAndPaid(t, 3100)

	// The provider refunds, then the answer is lost: the service cannot
	// know, retries with the same key, and the provider refunds nothing more.
	e.provider.TimeoutAfterWork(1)
	e.publish(t, order, "RefundRequested", map[string]any{
		"order_id": order, "payment_id": paymentID, "amount": 3100, "reason": "order_closed"})

	poll.Until(t, 30*time.Second, "the refund is DONE", func() bool { return e.refundDone(t, order) })
	if n := e.provider.Refunds(); n != 1 {
		t.Fatalf("provider made %d refunds, want 1", n)
	}
	if n := e.provider.RefundCalls(); n < 2 {
		t.Fatalf("provider was called %d times, want a retry after the timeout", n)
	}
	var attempts int
	var lastErr *string
	if err := e.db.Pool.QueryRow(context.Background(),
		`SELECT attempts, last_error FROM refunds WHERE order_id = $1`, order).Scan(&attempts, &lastErr); err != nil {
		t.Fatal(err)
	}
	if attempts < 2 || lastErr != nil {
		t.Fatalf("attempts %d, last_error %v: want a retry and the error cleared", attempts, lastErr)
	}
	evs := e.outboxRows(t, EventPaymentRefunded)
	if len(evs) != 1 {
		t.Fatalf("%d PaymentRefunded events, want 1", len(evs))
	}
	p := evs[0].Payload
	if evs[0].Subject != "payment."+order+".PaymentRefunded" || p["order_id"] != order || p["payment_id"] != paymentID ||
		p["amount"] != float64(3100) || p["refund_id"] == "" {
		t.Fatalf("PaymentRefunded %+v", evs[0])
	}
}

func TestDuplicateRefundRequestedRefundsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// A short duplicate window, set before anything is published (the
	// server schedules forgetting ids by the window in force at the first
	// publish, so shrinking it later may not take effect for minutes) and
	// before the consumer exists (nats-server 2.15.3 races a stream update
	// against a consumer being created).
	if _, err := e.js.UpdateStream(context.Background(), jetstream.StreamConfig{
		Name: "ORDERS", Subjects: []string{"orders.>"}, Storage: jetstream.FileStorage,
		Duplicates: 100 * time.Millisecond,
	}); err != nil {
		t.Fatal(err)
	}
	e.start(t)
	order, paymentID := e.closedAndPaid(t, 800)
	payload := map[string]any{"order_id": order, "payment_id": paymentID, "amount": 800, "reason": "order_closed"}

	e.mu.Lock()
	e.seqs[order]++
	seq := e.seqs[order]
	e.mu.Unlock()
	first := orderMsg(uuid.Must(uuid.NewV7()), order, "RefundRequested", seq, 1, mustJSON(t, payload))
	e.publishMsg(t, first)
	poll.Until(t, 30*time.Second, "the refund is DONE", func() bool { return e.refundDone(t, order) })

	// The same event delivered again, after the stream's duplicate window
	// has forgotten it (a relay republishing late): the inbox absorbs it.
	poll.Until(t, 30*time.Second, "the stream stores a second copy", func() bool { return !e.publishMsg(t, first).Duplicate })
	// The saga asking twice: a new event for the same payment.
	e.publish(t, order, "RefundRequested", payload)
	poll.Until(t, 30*time.Second, "payment-orders has handled every event", func() bool { return e.settled(t) })

	if n := e.count(t, `SELECT count(*) FROM refunds`); n != 1 {
		t.Fatalf("%d refunds recorded, want 1", n)
	}
	if n := e.provider.Refunds(); n != 1 {
		t.Fatalf("provider made %d refunds, want 1", n)
	}
	if n := len(e.outboxRows(t, EventPaymentRefunded)); n != 1 {
		t.Fatalf("%d PaymentRefunded events, want 1", n)
	}
	if dead, err := inbox.ListDeadLetters(context.Background(), e.db.Pool, ConsumerName, 10); err != nil || len(dead) != 0 {
		t.Fatalf("dead letters %+v (%v), want none", dead, err)
	}
}

func TestRefundRetryDelay(t *testing.T) {
	t.Parallel()
	s := &Service{refundBackoff: time.Second, refundBackoffMx: 10 * time.Second}
	for attempt, want := range map[int]time.Duration{0: time.Second, 1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 60: 10 * time.Second} {
		if got := s.refundRetryDelay(attempt); got != want {
			t.Errorf("attempt %d: %s, want %s", attempt, got, want)
		}
	}
}
