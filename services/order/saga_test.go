package order

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/inboxtest"
	"github.com/shop-ref/shop/pkg/saga"
	"github.com/shop-ref/shop/pkg/saga/sagatest"
	"github.com/shop-ref/shop/proof/poll"
)

func TestSagaHappyPath(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 250)
	o := e.create(t, "SKU-1", 4)
	if got := e.timeouts(t, o.ID); got != reservationTimeout {
		t.Fatalf("timeouts of a new order: %q, want the reservation deadline", got)
	}

	// The stock alone does not make the order payable: it shows PENDING,
	// with nothing to pay yet, until payment has opened its intent.
	e.publish(t, "inventory", o.ID, "InventoryReserved", map[string]any{"order_id": o.ID, "items": []any{map[string]any{"sku": "SKU-1", "quantity": 4}}})
	poll.Until(t, 15*time.Second, "the saga to hold the stock", func() bool {
		return e.sagaState(t, o.ID) == stockHeld
	})
	if got := e.get(t, o.ID); got.Status != Pending || got.Payment != nil || statuses(got) != "PENDING" {
		t.Fatalf("stock held, no intent yet: %s %s, payment %+v", got.Status, statuses(got), got.Payment)
	}
	intent := uuid.New()
	e.publish(t, "payment", o.ID, "PaymentOpened", map[string]any{"order_id": o.ID, "intent_id": intent, "amount": 1000})
	waiting := e.waitStatus(t, o.ID, WaitPay)
	if got := e.timeouts(t, o.ID); got != paymentTimeout {
		t.Fatalf("timeouts in WAIT_PAY: %q, want the payment deadline only", got)
	}
	p := e.payload(t, o.ID, "OrderAwaitingPayment")
	payBy, err := time.Parse(time.RFC3339, p["pay_by"].(string))
	if err != nil || p["total"] != float64(1000) || p["intent_id"] != intent.String() || time.Until(payBy) < 14*time.Minute {
		t.Fatalf("OrderAwaitingPayment %v (%v)", p, err)
	}
	// What a client pays, from the instant it says WAIT_PAY.
	if d := waiting.Payment; d == nil || d.IntentID != intent || d.Amount != 1000 || !d.PayBy.Equal(payBy) {
		t.Fatalf("WAIT_PAY shows payment %+v, want intent %s, 1000, due %s", d, intent, payBy)
	}
	sagatest.RequireTimeout(t, e.pool, o.ID.String(), "payment")

	e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "pay-1", "provider_payment_id": "pp-1", "amount": 1000})
	e.waitStatus(t, o.ID, Paid)
	p = e.payload(t, o.ID, "OrderPaid")
	if p["payment_id"] != "pay-1" || p["amount"] != float64(1000) || len(p["items"].([]any)) != 1 {
		t.Fatalf("OrderPaid %v", p)
	}
	if got := e.timeouts(t, o.ID); got != fulfillmentTimeout {
		t.Fatalf("timeouts in PAID: %q, want the fulfillment deadline only (the payment timeout goes with the payment)", got)
	}

	e.publish(t, "fulfillment", o.ID, "FulfillmentStarted", map[string]any{"order_id": o.ID, "shipment_id": "s-1"})
	e.waitStatus(t, o.ID, Fulfilling)
	e.publish(t, "fulfillment", o.ID, "ShipmentDelivered", map[string]any{"order_id": o.ID, "shipment_id": "s-1", "delivered_at": time.Now()})
	got := e.waitStatus(t, o.ID, Completed)
	if left := e.timeouts(t, o.ID); left != "" {
		t.Fatalf("timeouts of a completed order: %q, want none", left)
	}

	if statuses(got) != "PENDING WAIT_PAY PAID FULFILLING COMPLETED" {
		t.Fatalf("history %s", statuses(got))
	}
	for i := 1; i < len(got.History); i++ {
		if got.History[i].At.Before(got.History[i-1].At) {
			t.Fatalf("history not oldest first: %+v", got.History)
		}
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderAwaitingPayment", "OrderPaid", "OrderCompleted")
	if n := e.count(t, `SELECT version FROM orders WHERE order_id = $1`, o.ID); n != 5 {
		t.Fatalf("order version %d, want 5 (created + 4 transitions)", n)
	}
}

func TestSagaRejected(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	o := e.create(t, "SKU-1", 1)
	e.publish(t, "inventory", o.ID, "InventoryRejected", map[string]any{"order_id": o.ID, "reason": "insufficient_stock", "sku": "SKU-1"})
	got := e.waitStatus(t, o.ID, Rejected)
	if statuses(got) != "PENDING REJECTED" || got.History[1].Reason != "insufficient_stock" {
		t.Fatalf("history %+v", got.History)
	}
	if got := e.timeouts(t, o.ID); got != "" {
		t.Fatalf("timeouts of a rejected order: %q, want none", got)
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderRejected")
	if p := e.payload(t, o.ID, "OrderRejected"); p["reason"] != "insufficient_stock" {
		t.Fatalf("OrderRejected %v", p)
	}
}

func TestSagaPaymentFailed(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	o := e.create(t, "SKU-1", 1)
	e.payable(t, o.ID, false)
	e.waitStatus(t, o.ID, WaitPay)
	e.publish(t, "payment", o.ID, "PaymentFailed", map[string]any{"order_id": o.ID, "payment_id": "p-1", "amount": 100, "reason": "card_declined"})
	e.waitStatus(t, o.ID, Closed)
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderAwaitingPayment", "OrderClosed")
	if p := e.payload(t, o.ID, "OrderClosed"); p["reason"] != reasonPaymentFailed {
		t.Fatalf("OrderClosed %v", p)
	}
}

// overdue makes an order of SKU-1 (price 100) that waits for payment, and
// waits until its safety net has asked payment about it: the order as it
// first showed WAIT_PAY.
func (e *env) overdue(t *testing.T) (created, waiting Order) {
	t.Helper()
	e.stock(t, "SKU-1", 100)
	created = e.create(t, "SKU-1", 1)
	e.payable(t, created.ID, false)
	waiting = e.waitStatus(t, created.ID, WaitPay)
	poll.Until(t, 15*time.Second, "the order asks payment about its overdue intent", func() bool {
		return slices.Contains(e.events(t, created.ID), "OrderPaymentOverdue")
	})
	return created, waiting
}

// Payment owns the deadline: the order's own timer, long after pay_by,
// only asks payment again (OrderPaymentOverdue) and the order stays
// WAIT_PAY; it closes when payment says the intent expired.
func TestSagaClosesOnPaymentsExpiry(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{PaymentTimeout: 100 * time.Millisecond, PaymentOverdue: 100 * time.Millisecond})
	o, waiting := e.overdue(t)
	p := e.payload(t, o.ID, "OrderPaymentOverdue")
	if p["pay_by"] != waiting.Payment.PayBy.Format(time.RFC3339Nano) || p["intent_id"] != waiting.Payment.IntentID.String() {
		t.Fatalf("OrderPaymentOverdue %v, want the deadline and intent the order shows (%+v)", p, waiting.Payment)
	}
	if got := e.get(t, o.ID); got.Status != WaitPay {
		t.Fatalf("the order's own timer decided: %s, want WAIT_PAY until payment's word", got.Status)
	}

	e.publish(t, "payment", o.ID, "PaymentExpired", map[string]any{"order_id": o.ID, "intent_id": waiting.Payment.IntentID,
		"pay_by": waiting.Payment.PayBy, "expired_at": waiting.Payment.PayBy})
	got := e.waitStatus(t, o.ID, Closed)
	if got.History[len(got.History)-1].Reason != reasonPaymentTimeout {
		t.Fatalf("history %+v", got.History)
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderAwaitingPayment", "OrderPaymentOverdue", "OrderClosed")
	if p := e.payload(t, o.ID, "OrderClosed"); p["reason"] != reasonPaymentTimeout {
		t.Fatalf("OrderClosed %v", p)
	}
	if got := e.timeouts(t, o.ID); got != "" {
		t.Fatalf("timeouts of a closed order: %q, want none", got)
	}
}

// A capture payment accepted before pay_by is the order's payment however
// late its event arrives: long after the deadline, and after the order's
// own timer asked, the order goes on to PAID, with no refund.
func TestSagaPaymentArrivingLongAfterPayByIsApplied(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{PaymentTimeout: 100 * time.Millisecond, PaymentOverdue: 100 * time.Millisecond})
	o, _ := e.overdue(t)
	e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "pay-slow", "provider_payment_id": "pp-slow", "amount": 100})
	e.waitStatus(t, o.ID, Paid)
	if evs := e.events(t, o.ID); slices.Contains(evs, "RefundRequested") || slices.Contains(evs, "OrderClosed") {
		t.Fatalf("events %v: a payment accepted in time was refunded or closed", evs)
	}
}

// An order inventory never answers is closed when its reservation
// timeout falls due; a reservation that arrives after that changes
// nothing here (inventory releases it when it reads the OrderClosed that
// follows the OrderCreated it reserved for).
func TestSagaReservationTimeout(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{ReservationTimeout: time.Second})
	e.stock(t, "SKU-1", 100)
	o := e.create(t, "SKU-1", 1)
	got := e.waitStatus(t, o.ID, Closed)
	if statuses(got) != "PENDING CLOSED" || got.History[1].Reason != reasonReservationTimeout {
		t.Fatalf("history %+v", got.History)
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderClosed")
	if p := e.payload(t, o.ID, "OrderClosed"); p["reason"] != reasonReservationTimeout {
		t.Fatalf("OrderClosed %v", p)
	}
	if got := e.timeouts(t, o.ID); got != "" {
		t.Fatalf("timeouts of a closed order: %q, want none", got)
	}

	e.publish(t, "inventory", o.ID, "InventoryReserved", map[string]any{"order_id": o.ID, "items": []any{map[string]any{"sku": "SKU-1", "quantity": 1}}})
	poll.Until(t, 15*time.Second, "the late reservation to be recorded", func() bool {
		return e.unexpected(t, o.ID, "InventoryReserved", "CLOSED") == 1
	})
	if got := e.get(t, o.ID); got.Status != Closed || statuses(got) != "PENDING CLOSED" {
		t.Fatalf("after the late reservation: %s %s", got.Status, statuses(got))
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderClosed")

	// Inventory answered, payment never opened the intent: the order never
	// showed WAIT_PAY, and the same deadline closes it.
	held := e.create(t, "SKU-1", 1)
	e.publish(t, "inventory", held.ID, "InventoryReserved", map[string]any{"order_id": held.ID, "items": []any{}})
	got = e.waitStatus(t, held.ID, Closed)
	if statuses(got) != "PENDING CLOSED" || got.History[1].Reason != reasonReservationTimeout || got.Payment != nil {
		t.Fatalf("stock held, no intent: history %+v, payment %+v", got.History, got.Payment)
	}
	wantEvents(t, e.events(t, held.ID), "OrderCreated", "OrderClosed")
}

// Fulfillment never answers, or never delivers: the fulfillment deadline
// closes the paid order and refunds its payment once; a delivery that
// comes after is recorded as unexpected.
func TestSagaFulfillmentTimeout(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	paid := func() Order {
		o := e.create(t, "SKU-1", 2)
		e.payable(t, o.ID, false)
		e.waitStatus(t, o.ID, WaitPay)
		e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "pay-" + o.ID.String(), "amount": 200})
		e.waitStatus(t, o.ID, Paid)
		return o
	}
	never := paid() // fulfillment never starts
	started := paid()
	e.publish(t, "fulfillment", started.ID, "FulfillmentStarted", map[string]any{"order_id": started.ID, "shipment_id": "s-1"})
	e.waitStatus(t, started.ID, Fulfilling)
	for _, o := range []uuid.UUID{never.ID, started.ID} {
		if got := e.timeouts(t, o); got != fulfillmentTimeout {
			t.Fatalf("order %s: timeouts %q, want the fulfillment deadline", o, got)
		}
		// The deadline fires now, not in a day.
		sagatest.FireTimeout(t, e.pool, e.svc.saga, o.String(), fulfillmentTimeout)
	}
	for o, want := range map[uuid.UUID]string{never.ID: "PENDING WAIT_PAY PAID CLOSED", started.ID: "PENDING WAIT_PAY PAID FULFILLING CLOSED"} {
		got := e.waitStatus(t, o, Closed)
		if statuses(got) != want || got.History[len(got.History)-1].Reason != reasonFulfillmentTimeout {
			t.Fatalf("order %s: history %+v, want %s ending fulfillment_timeout", o, got.History, want)
		}
		wantEvents(t, e.events(t, o), "OrderCreated", "OrderAwaitingPayment", "OrderPaid", "OrderClosed", "RefundRequested")
		if p := e.payload(t, o, "RefundRequested"); p["payment_id"] != "pay-"+o.String() || p["amount"] != float64(200) || p["reason"] != reasonFulfillmentTimeout {
			t.Fatalf("RefundRequested %v", p)
		}
		if left := e.timeouts(t, o); left != "" {
			t.Fatalf("timeouts of the closed order: %q", left)
		}
	}
	// The shipment arrives after all, and the paying payment's event again:
	// recorded, nothing more refunded, the order stays CLOSED.
	e.publish(t, "fulfillment", started.ID, "ShipmentDelivered", map[string]any{"order_id": started.ID, "shipment_id": "s-1", "delivered_at": time.Now()})
	e.publish(t, "payment", started.ID, "PaymentSucceeded", map[string]any{"order_id": started.ID, "payment_id": "pay-" + started.ID.String(), "amount": 200})
	poll.Until(t, 15*time.Second, "the late delivery recorded", func() bool {
		return e.unexpected(t, started.ID, "ShipmentDelivered", "") == 1 &&
			len(inboxtest.Processed(t, e.pool, "order-payment")) == 5
	})
	if got := e.get(t, started.ID); got.Status != Closed {
		t.Fatalf("after the late delivery: %s", got.Status)
	}
	wantEvents(t, e.events(t, started.ID), "OrderCreated", "OrderAwaitingPayment", "OrderPaid", "OrderClosed", "RefundRequested")
}

// The two answers may come in either order; the order is payable once it
// holds both, and a payment that comes before (no client was told to pay
// yet) is refunded.
func TestSagaWaitsForBothAnswers(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	o := e.create(t, "SKU-1", 1)
	intent := uuid.New()
	e.publish(t, "payment", o.ID, "PaymentOpened", map[string]any{"order_id": o.ID, "intent_id": intent, "amount": 100})
	e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "early", "amount": 100})
	poll.Until(t, 15*time.Second, "the early payment's refund", func() bool {
		return e.written(t, o.ID, "RefundRequested") == 1
	})
	if p := e.payload(t, o.ID, "RefundRequested"); p["payment_id"] != "early" || p["reason"] != "order_not_awaiting_payment" {
		t.Fatalf("RefundRequested %v", p)
	}
	if got := e.get(t, o.ID); got.Status != Pending || got.Payment != nil {
		t.Fatalf("intent open, stock not held: %s, payment %+v", got.Status, got.Payment)
	}
	e.publish(t, "inventory", o.ID, "InventoryReserved", map[string]any{"order_id": o.ID, "items": []any{}})
	got := e.waitStatus(t, o.ID, WaitPay)
	if got.Payment == nil || got.Payment.IntentID != intent || got.Payment.Amount != 100 {
		t.Fatalf("WAIT_PAY shows payment %+v, want intent %s", got.Payment, intent)
	}
	if statuses(got) != "PENDING PENDING WAIT_PAY" || got.History[2].Reason != "payable" {
		t.Fatalf("history %+v", got.History)
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "RefundRequested", "OrderAwaitingPayment")
}

// Every way out of PENDING takes the reservation deadline with it, so it
// can never close an order that moved on.
func TestReservationTimeoutCancelledOnLeavingPending(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	cancelled := e.create(t, "SKU-1", 1)
	if res := e.do(t, http.MethodPost, "/orders/"+cancelled.ID.String()+"/cancel", "", "", nil); res.status != http.StatusAccepted {
		t.Fatalf("cancel: %d", res.status)
	}
	if got := e.timeouts(t, cancelled.ID); got != "" {
		t.Fatalf("timeouts of an order cancelled while PENDING: %q, want none", got)
	}
}

func TestLatePaymentRefundedOnce(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	o := e.create(t, "SKU-1", 1)
	e.payable(t, o.ID, false)
	e.waitStatus(t, o.ID, WaitPay)
	if res := e.do(t, http.MethodPost, "/orders/"+o.ID.String()+"/cancel", "", "", nil); res.status != http.StatusAccepted {
		t.Fatalf("cancel: %d", res.status)
	}

	paid := map[string]any{"order_id": o.ID, "payment_id": "late-1", "provider_payment_id": "pp", "amount": 100}
	m := e.publish(t, "payment", o.ID, "PaymentSucceeded", paid)
	// Delivered twice: the same message again, stored by the stream under
	// another message id (as after the duplicate window), and the same
	// payment once more under a new event id and sequence.
	again := nats.NewMsg(m.Subject)
	for k, v := range m.Header {
		again.Header[k] = v
	}
	again.Header.Set(jetstream.MsgIDHeader, uuid.NewString())
	again.Data = m.Data
	e.send(t, again)
	e.publish(t, "payment", o.ID, "PaymentSucceeded", paid)
	e.publish(t, "payment", o.ID, "PaymentRefunded", map[string]any{"order_id": o.ID, "payment_id": "late-1", "refund_id": "r-1", "amount": 100})

	poll.Until(t, 15*time.Second, "the refund to be recorded", func() bool {
		return e.count(t, `SELECT count(*) FROM order_history WHERE order_id = $1 AND reason = 'payment_refunded'`, o.ID) == 1
	})
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderAwaitingPayment", "OrderClosed", "RefundRequested")
	p := e.payload(t, o.ID, "RefundRequested")
	if p["payment_id"] != "late-1" || p["amount"] != float64(100) || p["reason"] != "order_closed" {
		t.Fatalf("RefundRequested %v", p)
	}
	if got := e.get(t, o.ID); got.Status != Closed {
		t.Fatalf("status %s", got.Status)
	}
}

func TestSecondPaymentOfPaidOrderRefunded(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	o := e.create(t, "SKU-1", 1)
	e.payable(t, o.ID, false)
	e.waitStatus(t, o.ID, WaitPay)
	e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "p-1", "amount": 100})
	e.waitStatus(t, o.ID, Paid)
	// The paying payment again (another event id) is not refunded; another
	// payment is.
	e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "p-1", "amount": 100})
	e.publish(t, "payment", o.ID, "PaymentSucceeded", map[string]any{"order_id": o.ID, "payment_id": "p-2", "amount": 100})
	poll.Until(t, 15*time.Second, "the refund", func() bool {
		return e.written(t, o.ID, "RefundRequested") == 1
	})
	if p := e.payload(t, o.ID, "RefundRequested"); p["payment_id"] != "p-2" || p["reason"] != "order_already_paid" {
		t.Fatalf("RefundRequested %v", p)
	}
	poll.Until(t, 15*time.Second, "every payment event processed", func() bool {
		return len(inboxtest.Processed(t, e.pool, "order-payment")) == 4 // with PaymentOpened
	})
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderAwaitingPayment", "OrderPaid", "RefundRequested")
}

func TestUnexpectedEventIgnored(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	o := e.create(t, "SKU-1", 1)
	if res := e.do(t, http.MethodPost, "/orders/"+o.ID.String()+"/cancel", "", "", nil); res.status != http.StatusAccepted {
		t.Fatalf("cancel: %d", res.status)
	}
	// The reservation comes after the cancel, then an event that does fit
	// nothing either: both are recorded, neither blocks the consumer.
	e.publish(t, "inventory", o.ID, "InventoryReserved", map[string]any{"order_id": o.ID})
	nobody := uuid.New()
	e.publish(t, "inventory", nobody, "InventoryReserved", map[string]any{})
	poll.Until(t, 15*time.Second, "the unexpected events to be recorded", func() bool {
		return e.unexpected(t, o.ID, "InventoryReserved", "") == 1 && e.unexpected(t, nobody, "InventoryReserved", "") == 1
	})
	if got := e.get(t, o.ID); got.Status != Closed || statuses(got) != "PENDING CLOSED" {
		t.Fatalf("order %s %s", got.Status, statuses(got))
	}
	wantEvents(t, e.events(t, o.ID), "OrderCreated", "OrderClosed")
	// The consumer still works.
	e.stock(t, "SKU-2", 7)
}

func TestCatalogueKeepsNewestPrice(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	e.stock(t, "SKU-1", 150)
	// A stale copy applied directly (as if the inbox's sequence check were
	// off) does not bring the old price back.
	err := pgx.BeginFunc(t.Context(), e.pool, func(tx pgx.Tx) error { return upsertProduct(t.Context(), tx, "SKU-1", 100, 1) })
	if err != nil {
		t.Fatal(err)
	}
	if n := e.count(t, `SELECT price FROM catalogue WHERE sku = 'SKU-1'`); n != 150 {
		t.Fatalf("price %d, want 150", n)
	}
}

func TestUnknownSchemaVersionIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	m := e.upstream("inventory", "product", "SKU-9", "ProductUpdated", map[string]any{"sku": "SKU-9", "price": 1})
	m.Header.Set("Schema-Version", "2")
	m.Header.Set(jetstream.MsgIDHeader, uuid.NewString())
	e.send(t, m)
	poll.Until(t, 15*time.Second, "the dead letter", func() bool {
		return e.deadLetters(t, "order-inventory") == 1
	})
	if n := e.count(t, `SELECT count(*) FROM catalogue`); n != 0 {
		t.Fatal("a version 2 event was applied")
	}
}

// Every upstream event the saga has a transition for must be in its
// consumer's Config.Handles: an event left out would only advance the
// cursor and never reach the saga.
func TestSagaEventsAreHandled(t *testing.T) {
	handled := slices.Concat(inventoryOutcomes, paymentOutcomes, fulfillmentOutcomes)
	for _, tr := range (&Service{}).transitions() {
		if tr.Event == evCancel || strings.HasPrefix(tr.Event, saga.TimeoutEvent("")) {
			continue // raised inside the order service, not consumed
		}
		if !slices.Contains(handled, tr.Event) {
			t.Errorf("the saga has a transition on %s, which no consumer's Handles lists", tr.Event)
		}
	}
}

// A saga consumer's handler applies a batch in stream order: saga events
// through Saga.ApplyBatch (an unexpected one recorded), a ProductUpdated
// among them in its place.
func TestHandlerAppliesTheBatchInOrder(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 250)
	a, b, c := e.create(t, "SKU-1", 1), e.create(t, "SKU-1", 2), e.create(t, "SKU-1", 3)
	msg := func(aggID string, seq int64, typ string, payload any) inbox.Batched {
		data, err := json.Marshal(payload)
		if err != nil {
			t.Fatal(err)
		}
		return inbox.Batched{Ctx: t.Context(), Message: inbox.Message{EventID: uuid.New(), Type: typ,
			AggregateID: aggID, Seq: seq, SchemaVersion: 1, Data: data}}
	}
	reserved := func(o Order) inbox.Batched {
		return msg(o.ID.String(), 1, "InventoryReserved", map[string]any{"order_id": o.ID, "items": []any{}})
	}
	batch := []inbox.Batched{
		reserved(a),
		msg("SKU-1", 99, "ProductUpdated", map[string]any{"sku": "SKU-1", "price": 300}),
		reserved(b),
		msg(c.ID.String(), 1, "InventoryRejected", map[string]any{"order_id": c.ID, "reason": "insufficient_stock"}),
		reserved(a), // a holds its stock by now: unexpected
	}
	handle := e.svc.handler(inventoryOutcomes)
	if err := pgx.BeginFunc(t.Context(), e.pool, func(tx pgx.Tx) error { return handle(t.Context(), tx, batch) }); err != nil {
		t.Fatal(err)
	}
	for o, want := range map[uuid.UUID]string{a.ID: stockHeld, b.ID: stockHeld, c.ID: Rejected} {
		if got := e.sagaState(t, o); got != want {
			t.Errorf("order %s: saga in %q, want %s", o, got, want)
		}
	}
	if n := e.count(t, `SELECT price FROM catalogue WHERE sku = 'SKU-1'`); n != 300 {
		t.Errorf("price %d, want 300", n)
	}
	if n := e.unexpected(t, a.ID, "InventoryReserved", ""); n != 1 {
		t.Errorf("%d unexpected records for the second InventoryReserved, want 1", n)
	}
}
