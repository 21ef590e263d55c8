package payment

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/poll"
)

// awaiting makes an order payment learned from ORDERS events up to
// OrderAwaitingPayment with the given deadline, and waits until payment
// keeps that deadline on its intent.
func (e *env) awaiting(t *testing.T, amount int64, payBy time.Time) string {
	t.Helper()
	payBy = payBy.Truncate(time.Microsecond) // what Postgres keeps
	order := uuid.NewString()
	e.publish(t, order, "OrderCreated", map[string]any{"order_id": order, "total": amount})
	e.publish(t, order, "OrderAwaitingPayment", map[string]any{"order_id": order, "total": amount,
		"pay_by": payBy.Format(time.RFC3339Nano)})
	poll.Until(t, 30*time.Second, "payment keeps the order's deadline", func() bool {
		var got *time.Time
		err := e.db.Pool.QueryRow(context.Background(), `SELECT pay_by FROM intents WHERE order_id = $1`, order).Scan(&got)
		return err == nil && got != nil && got.Equal(payBy)
	})
	return order
}

// events counts the outbox rows of one type for an order.
func (e *env) events(t *testing.T, order, typ string) int {
	t.Helper()
	return len(outboxtest.Written(t, e.db.Pool, outboxtest.Want{AggregateID: order, Type: typ}))
}

func TestIntentExpiresAtItsDeadline(t *testing.T) {
	t.Parallel()
	e := setup(t)
	payBy := e.clock().Add(time.Minute).Truncate(time.Microsecond)
	order := e.awaiting(t, 900, payBy)
	hdr := http.Header{"Content-Type": {"application/json"}}

	// Before the deadline nothing expires, however often the loop looks.
	time.Sleep(2 * e.svc.expiryPoll)
	if st := e.intentState(t, order); st != StatePayable {
		t.Fatalf("intent %s before its deadline, want PAYABLE", st)
	}

	// The customer pays at pay_by: refused at once, and nothing is
	// captured. The intent waits the grace for payments that arrived
	// before it, then expires.
	e.advance(time.Minute)
	rec := e.do(t, http.MethodPost, "/payments/"+order+"/simulate", []byte(`{"outcome":"succeeded"}`), hdr)
	wantProblem(t, rec, http.StatusConflict, "payment-window-closed")
	if rec.Header().Get("Retry-After") != "" {
		t.Fatal("payment-window-closed carries Retry-After: it is final")
	}
	if n := e.count(t, `SELECT count(*) FROM payments WHERE order_id = $1`, order); n != 0 {
		t.Fatalf("%d payments after a refused charge, want none", n)
	}
	if st := e.intentState(t, order); st != StatePayable {
		t.Fatalf("intent %s within the grace after pay_by, want PAYABLE", st)
	}

	e.advance(testGrace)
	poll.Until(t, 30*time.Second, "the intent expires", func() bool { return e.intentState(t, order) == StateExpired })
	evs := e.outboxRows(t, EventPaymentExpired)
	if len(evs) != 1 || evs[0].AggregateID != order || evs[0].Subject != "payment."+order+".PaymentExpired" {
		t.Fatalf("PaymentExpired events %+v, want one for %s", evs, order)
	}
	if got := evs[0].Payload["pay_by"]; got != payBy.UTC().Format(time.RFC3339Nano) {
		t.Fatalf("PaymentExpired pay_by %v, want %s", got, payBy.UTC().Format(time.RFC3339Nano))
	}
	wantProblem(t, e.do(t, http.MethodPost, "/payments/"+order+"/simulate", []byte(`{"outcome":"succeeded"}`), hdr),
		http.StatusConflict, "payment-window-closed")

	// The provider took money anyway (its own late capture): acknowledged,
	// rejected, refunded once; never PaymentSucceeded.
	cb := Callback{OrderID: order, ProviderPaymentID: "pay_after_expiry", Status: StatusSucceeded, Amount: 900}
	for range 2 { // and its replay is answered the same
		rec = e.signed(t, cb)
		wantStatus(t, rec, http.StatusOK)
		var res struct{ Status, Reason string }
		if err := json.Unmarshal(rec.Body.Bytes(), &res); err != nil || res.Status != StatusRejected || res.Reason != RejectWindowClosed {
			t.Fatalf("late webhook answered %s, want rejected %s", rec.Body, RejectWindowClosed)
		}
	}
	poll.Until(t, 30*time.Second, "the late capture is refunded", func() bool {
		return e.count(t, `SELECT count(*) FROM refunds WHERE order_id = $1 AND state = 'DONE'`, order) == 1
	})
	if n := e.events(t, order, EventPaymentSucceeded); n != 0 {
		t.Fatalf("%d PaymentSucceeded for an expired intent, want none", n)
	}
	if n := e.events(t, order, EventPaymentExpired); n != 1 {
		t.Fatalf("%d PaymentExpired, want still one", n)
	}
	if n := e.provider.Refunds(); n != 1 {
		t.Fatalf("provider made %d refunds, want 1", n)
	}
}

// A capture the deadline has passed, before the expiry loop got to it,
// expires the intent itself, in its own transaction: the order hears
// PaymentExpired before the rejected payment.
func TestCaptureAfterTheDeadlineExpiresTheIntentItself(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// The loop sleeps an hour: only the capture can expire the intent.
	e.svc.expiryPoll = time.Hour
	e.start(t)
	order := e.awaiting(t, 500, e.clock().Add(time.Hour))
	e.advance(time.Hour + testGrace)
	rec := e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_at_deadline", Status: StatusSucceeded, Amount: 500})
	wantStatus(t, rec, http.StatusOK)
	if _, status := decodeResult(t, rec.Body.Bytes()); status != StatusRejected {
		t.Fatalf("a capture at pay_by answered %s, want rejected: the deadline is exclusive", rec.Body)
	}
	if st := e.intentState(t, order); st != StateExpired {
		t.Fatalf("intent %s, want EXPIRED", st)
	}
	var expiredSeq, rejectedSeq int64
	for typ, dst := range map[string]*int64{EventPaymentExpired: &expiredSeq, EventPaymentRejected: &rejectedSeq} {
		if err := e.db.Pool.QueryRow(context.Background(),
			`SELECT aggregate_seq FROM outbox WHERE aggregate_id = $1 AND event_type = $2`, order, typ).Scan(dst); err != nil {
			t.Fatalf("%s: %v", typ, err)
		}
	}
	if expiredSeq >= rejectedSeq {
		t.Fatalf("PaymentExpired is event %d, PaymentRejected %d: the order must hear the expiry first", expiredSeq, rejectedSeq)
	}
}

// Whatever payment has not heard a deadline for, it does not expire: the
// order has not told it when (its consumer lags), so a capture is in time.
func TestNoDeadlineHeardNoExpiry(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order := uuid.NewString()
	e.publish(t, order, "OrderCreated", map[string]any{"order_id": order, "total": 300})
	poll.Until(t, 30*time.Second, "the intent is PAYABLE", func() bool { return e.intentState(t, order) == StatePayable })
	e.advance(24 * time.Hour)
	time.Sleep(2 * e.svc.expiryPoll)
	rec := e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_no_deadline", Status: StatusSucceeded, Amount: 300})
	wantStatus(t, rec, http.StatusOK)
	if _, status := decodeResult(t, rec.Body.Bytes()); status != StatusSucceeded {
		t.Fatalf("answered %s, want succeeded", rec.Body)
	}
	// The deadline heard afterwards, long past, changes nothing: the
	// intent is paid.
	e.publish(t, order, "OrderAwaitingPayment", map[string]any{"order_id": order, "total": 300,
		"pay_by": e.clock().Add(-time.Hour).Format(time.RFC3339Nano)})
	poll.Until(t, 30*time.Second, "payment-orders has handled every event", func() bool { return e.settled(t) })
	time.Sleep(2 * e.svc.expiryPoll)
	if st := e.intentState(t, order); st != StatePaid {
		t.Fatalf("intent %s, want PAID", st)
	}
	if n := e.events(t, order, EventPaymentExpired); n != 0 {
		t.Fatalf("%d PaymentExpired for a paid intent", n)
	}
}

// A success for an intent that no longer takes one is money the provider
// took: it is recorded as rejected and refunded, and never announced as
// PaymentSucceeded (which the saga would answer with a refund, after the
// customer was told "succeeded").
func TestSuccessForAnIntentThatTakesNoneIsRejected(t *testing.T) {
	t.Parallel()
	e := setup(t)
	for state, reason := range map[string]string{
		StateClosed: RejectOrderClosed, StatePaid: RejectAlreadyPaid, StateExpired: RejectWindowClosed,
	} {
		t.Run(state, func(t *testing.T) {
			order := e.intent(t, state, 1200)
			rec := e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_late_" + state, Status: StatusSucceeded, Amount: 1200})
			wantStatus(t, rec, http.StatusOK)
			var res struct{ Status, Reason string }
			if err := json.Unmarshal(rec.Body.Bytes(), &res); err != nil || res.Status != StatusRejected || res.Reason != reason {
				t.Fatalf("answered %s, want rejected %s", rec.Body, reason)
			}
			outboxtest.RequireWritten(t, e.db.Pool, outboxtest.Want{AggregateID: order, Type: EventPaymentRejected})
			outboxtest.RequireNotWritten(t, e.db.Pool, outboxtest.Want{AggregateID: order, Type: EventPaymentSucceeded})
			if n := e.count(t, `SELECT count(*) FROM refunds WHERE order_id = $1`, order); n != 1 {
				t.Fatalf("%d refunds, want 1", n)
			}
		})
	}
}

// Captures and the expiry race for the same intents, the clock moving
// through their deadlines meanwhile: each intent is captured or expired,
// never both, and what each callback was answered is what happened.
func TestCaptureAndExpiryRaceOneWins(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.svc.expiryPoll = time.Millisecond
	e.svc.cfg.CaptureGrace = time.Millisecond
	e.start(t)
	const n = 40
	start := e.clock()
	orders := make([]string, n)
	for i := range orders {
		// Deadlines 1 ms apart, through the window the clock crosses.
		orders[i] = e.awaiting(t, 100, start.Add(time.Duration(i+1)*time.Millisecond))
	}
	answers := make([]string, n)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	go func() { // the clock, in steps of 200 µs
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Microsecond):
				e.advance(200 * time.Microsecond)
			}
		}
	}()
	for i, order := range orders {
		wg.Go(func() {
			rec := e.signed(t, Callback{OrderID: order, ProviderPaymentID: fmt.Sprintf("pay_race_%d", i), Status: StatusSucceeded, Amount: 100})
			if rec.Code != http.StatusOK {
				t.Errorf("order %d: %d %s", i, rec.Code, rec.Body)
				return
			}
			_, answers[i] = decodeResult(t, rec.Body.Bytes())
		})
	}
	wg.Wait()
	close(stop)
	e.advance(time.Second) // every deadline past: what was not paid expires
	var succeeded, rejected int
	for i, order := range orders {
		poll.Until(t, 30*time.Second, "the intent settles", func() bool {
			st := e.intentState(t, order)
			return st == StatePaid || st == StateExpired
		})
		paid, expired := e.events(t, order, EventPaymentSucceeded), e.events(t, order, EventPaymentExpired)
		switch answers[i] {
		case StatusSucceeded:
			succeeded++
			if paid != 1 || expired != 0 || e.intentState(t, order) != StatePaid {
				t.Errorf("order %d answered succeeded: %d PaymentSucceeded, %d PaymentExpired, intent %s", i, paid, expired, e.intentState(t, order))
			}
		case StatusRejected:
			rejected++
			if paid != 0 || expired != 1 || e.intentState(t, order) != StateExpired {
				t.Errorf("order %d answered rejected: %d PaymentSucceeded, %d PaymentExpired, intent %s", i, paid, expired, e.intentState(t, order))
			}
		default:
			t.Errorf("order %d answered %q", i, answers[i])
		}
	}
	t.Logf("%d captured in time, %d after their deadline", succeeded, rejected)
}

// A payment is made when it arrives, not when it gets the intent's lock:
// one that arrived before pay_by and waited (for a connection, or the lock
// under load) is in time within the grace after pay_by, and the expiry
// waits that grace. One still waiting when the grace ends is refused: the
// intent expires, and the payment is answered as the outcome.
func TestAPaymentThatArrivedInTimeIsDecidedByItsArrival(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		wait  time.Duration // how far past pay_by the clock is when the lock is free
		want  string
		state string
	}{
		{"decided within the grace", testGrace / 2, StatusSucceeded, StatePaid},
		{"decided after the grace", testGrace, StatusRejected, StateExpired},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.svc.expiryPoll = 10 * time.Millisecond
			e.start(t)
			payBy := e.clock().Add(time.Second)
			order := e.awaiting(t, 800, payBy)

			// Another transaction holds the intent's row, as a busy one would.
			ctx := context.Background()
			tx, err := e.db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx) //nolint:errcheck // the lock is released by the commit below
			var holder int
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid() FROM intents WHERE order_id = $1 FOR UPDATE`, order).Scan(&holder); err != nil {
				t.Fatal(err)
			}
			answered := make(chan string, 1)
			go func() { // arrives before pay_by
				rec := e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_waited", Status: StatusSucceeded, Amount: 800})
				var res struct{ Status string }
				_ = json.Unmarshal(rec.Body.Bytes(), &res)
				answered <- res.Status
			}()
			poll.Until(t, 30*time.Second, "the callback waits for the intent's lock", func() bool {
				return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, holder) > 0
			})
			e.advance(time.Second + tc.wait)
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if got := <-answered; got != tc.want {
				t.Fatalf("answered %q, want %q", got, tc.want)
			}
			poll.Until(t, 30*time.Second, "the intent is "+tc.state, func() bool { return e.intentState(t, order) == tc.state })
			e.advance(time.Hour) // long past: a paid intent never expires
			time.Sleep(5 * e.svc.expiryPoll)
			if st := e.intentState(t, order); st != tc.state {
				t.Fatalf("intent %s, want %s", st, tc.state)
			}
		})
	}
}
