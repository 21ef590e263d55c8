package order

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/saga"
)

// The saga's own event types, besides the upstream events of docs/events.md.
const (
	evCancel           = "CustomerCancel" // POST /orders/{id}/cancel
	reservationTimeout = "reservation"    // the timeout armed with the order (PENDING)
	paymentTimeout     = "payment"        // the safety net set on entering WAIT_PAY, PaymentOverdue after pay_by
	fulfillmentTimeout = "fulfillment"    // the timeout set on entering PAID, kept through FULFILLING
)

// Reasons recorded in order_history and sent in OrderClosed.
const (
	reasonReservationTimeout = "reservation_timeout"
	reasonPaymentTimeout     = "payment_timeout"
	reasonCustomerCancel     = "customer_cancel"
	reasonPaymentFailed      = "payment_failed"
	reasonFulfillmentTimeout = "fulfillment_timeout"
)

// The saga's two join states. Inventory and payment both answer
// OrderCreated, in parallel: inventory by holding the stock, payment by
// opening the order's payment intent. The order moves to WAIT_PAY only when
// it holds both answers, so a client told to pay pays an intent that is
// open. While one answer is in, the saga is in one of these states and the
// order still shows PENDING (its status, and its history, name only the
// contract's states).
const (
	stockHeld   = "STOCK_HELD"   // InventoryReserved in, PaymentOpened not yet
	paymentOpen = "PAYMENT_OPEN" // PaymentOpened in, InventoryReserved not yet
)

// shown is the status an order in saga state st shows its clients: the
// contract's states only, so the join states show as PENDING.
func shown(st string) string {
	if st == stockHeld || st == paymentOpen {
		return Pending
	}
	return st
}

// sagaData is what the order saga remembers beyond its state: the intent
// payment opened, the payment that paid the order, and the payments it
// asked to refund, so a refund is requested once per payment however often
// (and under whatever event id) its PaymentSucceeded arrives.
type sagaData struct {
	IntentID  string   `json:"intent_id,omitempty"`
	PaymentID string   `json:"payment_id,omitempty"`
	Refunded  []string `json:"refunded,omitempty"`
}

// newSaga declares the order saga: the contract's state machine, one
// transition per (state, event). Pairs not listed (an InventoryReserved for
// a CLOSED order, say) are recorded by pkg/saga and ignored.
//
// The funcs queue their writes (order status, history, outbox events) on
// the step's batch, which Apply sends with the new state in one round trip;
// only the reads a func needs (the total, the items) take one of their own.
func (s *Service) newSaga() (*saga.Saga, error) {
	ts := s.transitions()
	for i, t := range ts {
		ts[i].Func = withOrderID(t.Func)
	}
	return saga.New("order", ts...)
}

// withOrderID names the order on the transition's span (shop.order_id),
// then runs f.
func withOrderID(f saga.TransitionFunc) saga.TransitionFunc {
	return func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
		trace.SpanFromContext(ctx).SetAttributes(attribute.String("shop.order_id", st.Instance.ID))
		if f == nil {
			return nil
		}
		return f(ctx, tx, st)
	}
}

// transitions are the order saga's transitions (see newSaga).
func (s *Service) transitions() []saga.Transition {
	ts := []saga.Transition{
		// The join: both answers to OrderCreated, in either order, then
		// WAIT_PAY. Payment's PaymentOpened commits with the intent it
		// announces, so an order shows WAIT_PAY only when payment will take
		// the money (docs/architecture.md, "Paying the moment the order
		// says so").
		{From: Pending, Event: "InventoryReserved", To: stockHeld},
		{From: Pending, Event: "PaymentOpened", To: paymentOpen, Func: s.noteIntent},
		{From: stockHeld, Event: "PaymentOpened", To: WaitPay, Func: s.awaitPayment},
		{From: paymentOpen, Event: "InventoryReserved", To: WaitPay, Func: s.awaitPayment},
		{From: WaitPay, Event: "PaymentSucceeded", To: Paid, Func: s.paid},
		{From: WaitPay, Event: "PaymentFailed", To: Closed, Func: s.closeFunc(reasonPaymentFailed)},
		// Payment owns the deadline (docs/architecture.md, "Who decides the
		// deadline"): the order closes when payment says the intent expired
		// unpaid, never on a timer of its own, so a capture payment accepted
		// before pay_by is never lost to an event that travelled slowly.
		{From: WaitPay, Event: "PaymentExpired", To: Closed, Func: s.closeFunc(reasonPaymentTimeout)},
		// The order's own timer is a safety net long after pay_by: it asks
		// payment again and decides nothing.
		{From: WaitPay, Event: saga.TimeoutEvent(paymentTimeout), To: WaitPay, Func: s.askPayment},
		{From: WaitPay, Event: evCancel, To: Closed, Func: s.closeFunc(reasonCustomerCancel)},
		{From: Paid, Event: "FulfillmentStarted", To: Fulfilling, Func: s.moveFunc("fulfillment_started", "")},
		{From: Fulfilling, Event: "ShipmentDelivered", To: Completed, Func: s.complete},
		// Fulfillment never delivered: the order ends, and its money goes
		// back (every non-final state has a durable deadline).
		{From: Paid, Event: saga.TimeoutEvent(fulfillmentTimeout), To: Closed, Func: s.closeUndelivered},
		{From: Fulfilling, Event: saga.TimeoutEvent(fulfillmentTimeout), To: Closed, Func: s.closeUndelivered},
	}
	// What the order shows as PENDING: the saga's first state and its two
	// join states.
	for _, st := range []string{Pending, stockHeld, paymentOpen} {
		ts = append(ts,
			saga.Transition{From: st, Event: evCancel, To: Closed, Func: s.closeFunc(reasonCustomerCancel)},
			// Inventory or payment never answered. OrderClosed follows
			// OrderCreated in ORDERS, and inventory and payment read both in
			// sequence: a reservation inventory makes later is released when
			// it reads the close (or it leaves a tombstone and never
			// reserves), so the stock comes back, the intent is closed, and
			// a late answer is recorded as unexpected here.
			saga.Transition{From: st, Event: saga.TimeoutEvent(reservationTimeout), To: Closed, Func: s.closeFunc(reasonReservationTimeout)})
		if st != stockHeld { // stock held is never rejected after
			ts = append(ts, saga.Transition{From: st, Event: "InventoryRejected", To: Rejected, Func: s.reject})
		}
	}
	all := []string{Pending, stockHeld, paymentOpen, WaitPay, Paid, Fulfilling, Completed, Rejected, Closed}
	for _, st := range all {
		// Money taken in any state but WAIT_PAY goes back.
		if st != WaitPay {
			ts = append(ts, saga.Transition{From: st, Event: "PaymentSucceeded", To: st, Func: s.refund})
		}
		ts = append(ts, saga.Transition{From: st, Event: "PaymentRefunded", To: st, Func: s.refunded})
	}
	return ts
}

// orderTotal reads what order id costs, for the events that carry it.
func orderTotal(ctx context.Context, tx pgx.Tx, id uuid.UUID) (int64, error) {
	var total int64
	if err := tx.QueryRow(ctx, `SELECT total FROM orders WHERE order_id = $1`, id).Scan(&total); err != nil {
		return 0, fmt.Errorf("read order %s: %w", id, err)
	}
	return total, nil
}

// payload decodes an event's data; a payload that does not decode never
// will, so it is poison.
func payload[T any](st *saga.Step) (T, error) {
	var v T
	if err := json.Unmarshal(st.Event.Data, &v); err != nil {
		return v, inbox.Poison(fmt.Errorf("%s payload: %w", st.Event.Type, err))
	}
	return v, nil
}

func data(st *saga.Step) (sagaData, error) {
	var d sagaData
	if err := json.Unmarshal(st.Instance.Data, &d); err != nil {
		return d, fmt.Errorf("saga data of %s: %w", st.Instance.ID, err)
	}
	return d, nil
}

func setData(st *saga.Step, d sagaData) error {
	b, err := json.Marshal(d)
	if err != nil {
		return fmt.Errorf("encode saga data: %w", err)
	}
	st.Data = b
	return nil
}

func stepOrder(st *saga.Step) (uuid.UUID, error) {
	id, err := uuid.Parse(st.Instance.ID)
	if err != nil {
		return id, fmt.Errorf("saga %s is not an order id: %w", st.Instance.ID, err)
	}
	return id, nil
}

// intentOpened is the payload of payment's PaymentOpened.
type intentOpened struct {
	IntentID string `json:"intent_id"`
}

// noteIntent: PENDING → PAYMENT_OPEN. The intent is remembered until the
// stock is held too.
func (s *Service) noteIntent(_ context.Context, _ pgx.Tx, st *saga.Step) error {
	p, err := payload[intentOpened](st)
	if err != nil {
		return err
	}
	d, err := data(st)
	if err != nil {
		return err
	}
	d.IntentID = p.IntentID
	return setData(st, d)
}

// awaitPayment: STOCK_HELD or PAYMENT_OPEN → WAIT_PAY, on the second of the
// two answers. The pay-by time is decided here, once: shown by the order and
// sent to payment in OrderAwaitingPayment, which keeps it and decides by it.
// The reservation timeout goes in the same transaction: a reservation and
// its timeout can never both take effect. The order now shows what a
// client pays (the intent and the pay-by time).
func (s *Service) awaitPayment(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
	id, err := stepOrder(st)
	if err != nil {
		return err
	}
	d, err := data(st)
	if err != nil {
		return err
	}
	if st.Event.Type == "PaymentOpened" {
		p, err := payload[intentOpened](st)
		if err != nil {
			return err
		}
		d.IntentID = p.IntentID
	}
	intent, err := uuid.Parse(d.IntentID)
	if err != nil {
		return inbox.Poison(fmt.Errorf("order %s: PaymentOpened names no intent (%q): %w", id, d.IntentID, err))
	}
	if err := setData(st, d); err != nil {
		return err
	}
	total, err := orderTotal(ctx, tx, id)
	if err != nil {
		return err
	}
	payBy := now().Add(s.cfg.PaymentTimeout)
	st.CancelTimeout(reservationTimeout)
	st.SetTimeout(paymentTimeout, payBy.Add(s.cfg.PaymentOverdue))
	queuePaymentDue(st.Batch(), id, intent, payBy)
	queueStatus(st.Batch(), id, st.To, "payable") // stock held, intent open
	return s.outbox.Queue(ctx, st.Batch(), event(id, "OrderAwaitingPayment", map[string]any{
		"order_id": id, "total": total, "pay_by": payBy.Format(time.RFC3339Nano), "intent_id": intent,
	}))
}

// askPayment: WAIT_PAY, PaymentOverdue after pay_by, and payment has said
// neither "paid" nor "expired" (it is down, or far behind, or never read
// OrderAwaitingPayment). The order asks again, with the deadline, in
// OrderPaymentOverdue, and keeps waiting for payment's word: payment
// expires the intent on reading it, unless a capture came first. Closing
// here instead would race a capture payment may have accepted and not yet
// announced.
func (s *Service) askPayment(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
	id, err := stepOrder(st)
	if err != nil {
		return err
	}
	d, err := data(st)
	if err != nil {
		return err
	}
	var payBy time.Time
	if err := tx.QueryRow(ctx, `SELECT pay_by FROM orders WHERE order_id = $1`, id).Scan(&payBy); err != nil {
		return fmt.Errorf("read pay_by of order %s: %w", id, err)
	}
	s.log.Warn("payment has not settled an order long past its pay_by; asking again",
		"order_id", id, "pay_by", payBy, "overdue", now().Sub(payBy).Round(time.Second))
	return s.outbox.Queue(ctx, st.Batch(), event(id, "OrderPaymentOverdue", map[string]any{
		"order_id": id, "intent_id": d.IntentID, "pay_by": payBy.UTC().Format(time.RFC3339Nano),
	}))
}

// reject: PENDING (or PAYMENT_OPEN) → REJECTED; inventory holds nothing, but OrderRejected
// tells it (and payment) the saga has ended.
func (s *Service) reject(ctx context.Context, _ pgx.Tx, st *saga.Step) error {
	id, err := stepOrder(st)
	if err != nil {
		return err
	}
	p, err := payload[struct {
		Reason string `json:"reason"`
	}](st)
	if err != nil {
		return err
	}
	reason := p.Reason
	if reason == "" {
		reason = "inventory_rejected"
	}
	st.CancelTimeout(reservationTimeout)
	queueStatus(st.Batch(), id, st.To, reason)
	return s.outbox.Queue(ctx, st.Batch(), event(id, "OrderRejected", map[string]any{"order_id": id, "reason": reason}))
}

// closeFunc: PENDING (or a join state) or WAIT_PAY → CLOSED. OrderClosed makes inventory
// release the stock (or not reserve it, if its reservation is still to come).
// Whichever timeout the state had goes with it.
func (s *Service) closeFunc(reason string) saga.TransitionFunc {
	return func(ctx context.Context, _ pgx.Tx, st *saga.Step) error {
		id, err := stepOrder(st)
		if err != nil {
			return err
		}
		st.CancelTimeout(reservationTimeout)
		st.CancelTimeout(paymentTimeout)
		queueStatus(st.Batch(), id, st.To, reason)
		return s.outbox.Queue(ctx, st.Batch(), event(id, "OrderClosed", map[string]any{"order_id": id, "reason": reason}))
	}
}

type payment struct {
	OrderID   string `json:"order_id"`
	PaymentID string `json:"payment_id"`
	Amount    int64  `json:"amount"`
}

// paid: WAIT_PAY → PAID. The timeout is cancelled in the same transaction,
// so a payment and its timeout can never both take effect.
func (s *Service) paid(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
	id, err := stepOrder(st)
	if err != nil {
		return err
	}
	p, err := payload[payment](st)
	if err != nil {
		return err
	}
	d, err := data(st)
	if err != nil {
		return err
	}
	d.PaymentID = p.PaymentID
	if err := setData(st, d); err != nil {
		return err
	}
	st.CancelTimeout(paymentTimeout)
	// Failure window: fulfillment never answers (down, its consumer
	// stopped, an event lost for good). The order would stay PAID or
	// FULFILLING for ever; the deadline closes it and refunds.
	st.SetTimeout(fulfillmentTimeout, now().Add(s.cfg.FulfillmentTimeout))
	type line struct {
		SKU      string `json:"sku"`
		Quantity int    `json:"quantity"`
	}
	rows, _ := tx.Query(ctx, `SELECT sku, quantity FROM order_items WHERE order_id = $1 ORDER BY line`, id)
	items, err := pgx.CollectRows(rows, pgx.RowToStructByPos[line])
	if err != nil {
		return fmt.Errorf("read items of order %s: %w", id, err)
	}
	queueStatus(st.Batch(), id, st.To, "payment_succeeded")
	return s.outbox.Queue(ctx, st.Batch(), event(id, "OrderPaid", map[string]any{
		"order_id": id, "payment_id": p.PaymentID, "amount": p.Amount, "items": items,
	}))
}

// moveFunc is a transition that records the new state and, when emit is
// set, emits that event with the payload {"order_id"}.
func (s *Service) moveFunc(reason, emit string) saga.TransitionFunc {
	return func(ctx context.Context, _ pgx.Tx, st *saga.Step) error {
		id, err := stepOrder(st)
		if err != nil {
			return err
		}
		queueStatus(st.Batch(), id, st.To, reason)
		if emit == "" {
			return nil
		}
		return s.outbox.Queue(ctx, st.Batch(), event(id, emit, map[string]any{"order_id": id}))
	}
}

// complete: FULFILLING → COMPLETED, with OrderCompleted; the fulfillment
// deadline goes in the same transaction, so a delivery and its deadline
// can never both take effect.
func (s *Service) complete(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
	st.CancelTimeout(fulfillmentTimeout)
	return s.moveFunc("shipment_delivered", "OrderCompleted")(ctx, tx, st)
}

// closeUndelivered: PAID or FULFILLING → CLOSED when the fulfillment
// deadline falls due: OrderClosed (reason fulfillment_timeout) and a
// RefundRequested for the payment that paid the order, once. The sold
// units stay sold: a shipment that started may be on its way, and what
// never left is an operator's to restock. A delivery that comes after is
// recorded as unexpected.
func (s *Service) closeUndelivered(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
	id, err := stepOrder(st)
	if err != nil {
		return err
	}
	d, err := data(st)
	if err != nil {
		return err
	}
	total, err := orderTotal(ctx, tx, id)
	if err != nil {
		return err
	}
	queueStatus(st.Batch(), id, st.To, reasonFulfillmentTimeout)
	if err := s.outbox.Queue(ctx, st.Batch(), event(id, "OrderClosed", map[string]any{"order_id": id, "reason": reasonFulfillmentTimeout})); err != nil {
		return err
	}
	if d.PaymentID == "" || slices.Contains(d.Refunded, d.PaymentID) {
		return nil
	}
	d.Refunded = append(d.Refunded, d.PaymentID)
	if err := setData(st, d); err != nil {
		return err
	}
	return s.outbox.Queue(ctx, st.Batch(), event(id, "RefundRequested", map[string]any{
		"order_id": id, "payment_id": d.PaymentID, "amount": total, "reason": reasonFulfillmentTimeout,
	}))
}

// refund: a PaymentSucceeded for an order that is not waiting for payment.
// The order keeps its state; the money goes back, once per payment id. The
// payment that paid this order is not refunded (a copy of its event under
// another id changes nothing).
func (s *Service) refund(ctx context.Context, _ pgx.Tx, st *saga.Step) error {
	id, err := stepOrder(st)
	if err != nil {
		return err
	}
	p, err := payload[payment](st)
	if err != nil {
		return err
	}
	d, err := data(st)
	if err != nil {
		return err
	}
	if p.PaymentID == d.PaymentID || slices.Contains(d.Refunded, p.PaymentID) {
		return nil
	}
	d.Refunded = append(d.Refunded, p.PaymentID)
	if err := setData(st, d); err != nil {
		return err
	}
	reason := map[string]string{
		Closed:      "order_closed",
		Rejected:    "order_rejected",
		Pending:     "order_not_awaiting_payment",
		stockHeld:   "order_not_awaiting_payment",
		paymentOpen: "order_not_awaiting_payment",
	}[st.Instance.State]
	if reason == "" {
		reason = "order_already_paid"
	}
	queueStatus(st.Batch(), id, shown(st.To), "refund_requested")
	return s.outbox.Queue(ctx, st.Batch(), event(id, "RefundRequested", map[string]any{
		"order_id": id, "payment_id": p.PaymentID, "amount": p.Amount, "reason": reason,
	}))
}

// refunded: payment confirmed a refund; the history shows it, the state
// stays.
func (s *Service) refunded(_ context.Context, _ pgx.Tx, st *saga.Step) error {
	id, err := stepOrder(st)
	if err != nil {
		return err
	}
	queueStatus(st.Batch(), id, shown(st.To), "payment_refunded")
	return nil
}
