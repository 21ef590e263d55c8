package payment

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/poll"
)

// rejectedResult is the webhook's answer to a success it cannot apply.
type rejectedResult struct {
	PaymentID string `json:"payment_id"`
	Status    string `json:"status"`
	Reason    string `json:"reason"`
}

// refundOf reads the refund of payment id: its state and how often the
// provider was asked.
func (e *env) refundOf(t *testing.T, paymentID string) (state string, attempts int, key uuid.UUID) {
	t.Helper()
	if err := e.db.Pool.QueryRow(context.Background(),
		`SELECT state, attempts, idempotency_key FROM refunds WHERE payment_id = $1`, paymentID).Scan(&state, &attempts, &key); err != nil {
		t.Fatalf("refund of payment %s: %v", paymentID, err)
	}
	return state, attempts, key
}

// A success the order cannot take (another amount, an order payment does
// not know) is money the provider holds: it is recorded
// as a rejected payment with its PaymentRejected event, answered 200 (so
// the provider stops sending it), and refunded through the provider, keyed
// by the payment id. A replay, before or after the refund, is answered the
// same way and refunds nothing more.
func TestRejectedPaymentsAreRecordedAndRefunded(t *testing.T) {
	t.Parallel()
	e := setup(t)
	payable := e.intent(t, StatePayable, 1000)
	unknown := uuid.NewString()

	for _, tc := range []struct {
		name   string
		cb     Callback
		reason string
	}{
		{"amount mismatch", Callback{OrderID: payable, ProviderPaymentID: "pay_short", Status: StatusSucceeded, Amount: 999}, RejectAmountMismatch},
		{"unknown order", Callback{OrderID: unknown, ProviderPaymentID: "pay_stray", Status: StatusSucceeded, Amount: 700}, RejectUnknownOrder},
	} {
		t.Run(tc.name, func(t *testing.T) {
			refundsBefore := e.provider.Refunds()
			rec := e.signed(t, tc.cb)
			wantStatus(t, rec, http.StatusOK)
			var res rejectedResult
			if err := json.Unmarshal(rec.Body.Bytes(), &res); err != nil || res.Status != StatusRejected || res.Reason != tc.reason || res.PaymentID == "" {
				t.Fatalf("answer %s (%v), want status rejected, reason %s", rec.Body, err, tc.reason)
			}
			if rec.Header().Get("Idempotent-Replayed") != "" {
				t.Fatal("the first callback is marked as a replay")
			}
			p, err := paymentByID(context.Background(), e.db.Pool, uuid.MustParse(res.PaymentID))
			if err != nil || p.Status != StatusRejected || p.RejectReason != tc.reason || p.Amount != tc.cb.Amount ||
				p.OrderID != tc.cb.OrderID || p.ProviderPaymentID != tc.cb.ProviderPaymentID {
				t.Fatalf("recorded %+v (%v)", p, err)
			}
			var ev *outboxRow
			for _, r := range e.outboxRows(t, EventPaymentRejected) {
				if r.Payload["payment_id"] == res.PaymentID {
					ev = &r
				}
			}
			if ev == nil || ev.Subject != "payment."+tc.cb.OrderID+".PaymentRejected" || ev.AggregateID != tc.cb.OrderID ||
				ev.Payload["reason"] != tc.reason || ev.Payload["amount"] != float64(tc.cb.Amount) ||
				ev.Payload["provider_payment_id"] != tc.cb.ProviderPaymentID {
				t.Fatalf("PaymentRejected %+v", ev)
			}
			// A rejected payment never announces PaymentSucceeded: the saga would take it.
			outboxtest.RequireNotWritten(t, e.db.Pool, outboxtest.Want{AggregateID: tc.cb.OrderID, Type: "PaymentSucceeded"})

			replay := func(when string) {
				t.Helper()
				e.advance(time.Second) // a later delivery, freshly signed
				rec := e.signed(t, tc.cb)
				wantStatus(t, rec, http.StatusOK)
				var again rejectedResult
				if err := json.Unmarshal(rec.Body.Bytes(), &again); err != nil || again != res {
					t.Fatalf("replay %s answered %s, want %+v", when, rec.Body, res)
				}
				if rec.Header().Get("Idempotent-Replayed") != "true" {
					t.Fatalf("replay %s not marked Idempotent-Replayed", when)
				}
				if n := e.count(t, `SELECT count(*) FROM payments WHERE provider_payment_id = $1`, tc.cb.ProviderPaymentID); n != 1 {
					t.Fatalf("replay %s: %d payments, want 1", when, n)
				}
				if n := e.count(t, `SELECT count(*) FROM refunds WHERE payment_id = $1`, res.PaymentID); n != 1 {
					t.Fatalf("replay %s: %d refunds, want 1", when, n)
				}
				if n := len(outboxtest.Written(t, e.db.Pool, outboxtest.Want{AggregateID: tc.cb.OrderID, Type: "PaymentRejected"})); n != 1 {
					t.Fatalf("replay %s: %d PaymentRejected events, want 1", when, n)
				}
			}
			replay("before the refund is done") // possibly: the refund loop may be quick

			poll.Until(t, 30*time.Second, "the refund is DONE", func() bool { state, _, _ := e.refundOf(t, res.PaymentID); return state == RefundDone })
			_, _, key := e.refundOf(t, res.PaymentID)
			if key.String() != res.PaymentID {
				t.Fatalf("refund idempotency key %s, want the payment id %s", key, res.PaymentID)
			}
			if n := e.provider.Refunds() - refundsBefore; n != 1 {
				t.Fatalf("the provider made %d refunds, want 1", n)
			}
			var refunded *outboxRow
			for _, r := range e.outboxRows(t, EventPaymentRefunded) {
				if r.Payload["payment_id"] == res.PaymentID {
					refunded = &r
				}
			}
			if refunded == nil || refunded.Payload["amount"] != float64(tc.cb.Amount) || refunded.AggregateID != tc.cb.OrderID {
				t.Fatalf("PaymentRefunded %+v", refunded)
			}

			// The order moves on (it is paid): the callback recorded once is
			// still answered as it was.
			if _, err := e.db.Pool.Exec(context.Background(), `UPDATE intents SET state = 'PAID' WHERE order_id = $1`, tc.cb.OrderID); err != nil {
				t.Fatal(err)
			}
			replay("after the refund")
			if n := e.provider.Refunds() - refundsBefore; n != 1 {
				t.Fatalf("after the replays the provider made %d refunds, want 1", n)
			}
			if n := len(outboxtest.Written(t, e.db.Pool, outboxtest.Want{AggregateID: tc.cb.OrderID, Type: "PaymentRefunded"})); n != 1 {
				t.Fatalf("%d PaymentRefunded events, want 1", n)
			}
		})
	}

	t.Run("a failure of another amount is still refused", func(t *testing.T) {
		order := e.intent(t, StatePayable, 1000)
		wantProblem(t, e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_failed_short", Status: StatusFailed, Amount: 999}),
			http.StatusUnprocessableEntity, "amount-mismatch")
		if n := e.count(t, `SELECT count(*) FROM payments WHERE order_id = $1`, order); n != 0 {
			t.Fatalf("%d payments for a refused failure", n)
		}
	})
	t.Run("nothing taken, nothing to refund", func(t *testing.T) {
		order := e.intent(t, StatePayable, 1000)
		rec := e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_zero", Status: StatusSucceeded, Amount: 0})
		wantStatus(t, rec, http.StatusOK)
		if n := e.count(t, `SELECT count(*) FROM payments WHERE order_id = $1 AND status = 'rejected'`, order); n != 1 {
			t.Fatalf("%d rejected payments, want 1", n)
		}
		if n := e.count(t, `SELECT count(*) FROM refunds WHERE order_id = $1`, order); n != 0 {
			t.Fatalf("%d refunds of nothing", n)
		}
	})
}

// Twins of a success for an order payment does not know have no intent
// row to take turns on; the unique provider payment id still lets only one
// of them record (and refund) it.
func TestConcurrentTwinsOfAnUnknownOrderRefundOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cb := Callback{OrderID: uuid.NewString(), ProviderPaymentID: "pay_stray_twin", Status: StatusSucceeded, Amount: 450}
	var wg sync.WaitGroup
	ids := make([]string, 8)
	for i := range ids {
		wg.Go(func() {
			rec := e.signed(t, cb)
			if rec.Code != http.StatusOK {
				t.Errorf("twin %d: status %d %s", i, rec.Code, rec.Body)
				return
			}
			ids[i], _ = decodeResult(t, rec.Body.Bytes())
		})
	}
	wg.Wait()
	for _, id := range ids {
		if id != ids[0] {
			t.Fatalf("twins answered different payments: %v", ids)
		}
	}
	if n := e.count(t, `SELECT (SELECT count(*) FROM payments) + (SELECT count(*) FROM refunds)`) +
		len(outboxtest.Written(t, e.db.Pool, outboxtest.Want{Type: "PaymentRejected"})); n != 3 {
		t.Fatalf("%d payments, refunds and PaymentRejected events, want one of each", n)
	}
	poll.Until(t, 30*time.Second, "the refund is DONE", func() bool { state, _, _ := e.refundOf(t, ids[0]); return state == RefundDone })
	if n := e.provider.Refunds(); n != 1 {
		t.Fatalf("the provider made %d refunds, want 1", n)
	}
}

// While the provider cannot refund, the rejected payment's refund stays
// REQUESTED (verify and the reconciler report it meanwhile) and is retried
// with the same key until it goes through.
func TestRejectedPaymentRefundWaitsForTheProvider(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.svc.refundPoll, e.svc.refundBackoff, e.svc.refundBackoffMx = 20*time.Millisecond, 20*time.Millisecond, 50*time.Millisecond
	e.provider.SetDown(true)
	e.start(t)
	rec := e.signed(t, Callback{OrderID: e.intent(t, StatePayable, 801), ProviderPaymentID: "pay_down", Status: StatusSucceeded, Amount: 800})
	wantStatus(t, rec, http.StatusOK)
	paymentID, _ := decodeResult(t, rec.Body.Bytes())

	poll.Until(t, 30*time.Second, "the provider to refuse a few attempts", func() bool { _, attempts, _ := e.refundOf(t, paymentID); return attempts >= 3 })
	var lastErr string
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT state || ': ' || coalesce(last_error, '') FROM refunds WHERE payment_id = $1`,
		paymentID).Scan(&lastErr); err != nil || lastErr != RefundRequested+": "+ErrProviderUnavailable.Error() {
		t.Fatalf("refund while the provider is down: %q (%v)", lastErr, err)
	}
	if n := e.provider.Refunds(); n != 0 {
		t.Fatalf("the provider refunded %d while down", n)
	}

	e.provider.SetDown(false)
	poll.Until(t, 30*time.Second, "the refund is DONE", func() bool { state, _, _ := e.refundOf(t, paymentID); return state == RefundDone })
	if n := e.provider.Refunds(); n != 1 {
		t.Fatalf("the provider made %d refunds, want 1", n)
	}
}
