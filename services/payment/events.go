package payment

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Event types payment publishes to the PAYMENT stream (docs/events.md).
const (
	EventPaymentOpened    = "PaymentOpened"
	EventPaymentSucceeded = "PaymentSucceeded"
	EventPaymentFailed    = "PaymentFailed"
	EventPaymentRefunded  = "PaymentRefunded"
	EventPaymentRejected  = "PaymentRejected"
	EventPaymentExpired   = "PaymentExpired"
)

// PaymentOpened is the payload of a PaymentOpened event: payment has opened
// the order's intent and takes a payment of Amount for it from now on.
type PaymentOpened struct {
	OrderID  string    `json:"order_id"`
	IntentID uuid.UUID `json:"intent_id"`
	Amount   int64     `json:"amount"`
}

// PaymentSucceeded is the payload of a PaymentSucceeded event.
type PaymentSucceeded struct {
	OrderID           string    `json:"order_id"`
	PaymentID         uuid.UUID `json:"payment_id"`
	ProviderPaymentID string    `json:"provider_payment_id"`
	Amount            int64     `json:"amount"`
}

// PaymentFailed is the payload of a PaymentFailed event.
type PaymentFailed struct {
	OrderID           string    `json:"order_id"`
	PaymentID         uuid.UUID `json:"payment_id"`
	ProviderPaymentID string    `json:"provider_payment_id"`
	Amount            int64     `json:"amount"`
	Reason            string    `json:"reason"`
}

// PaymentRejected is the payload of a PaymentRejected event: the provider
// took Amount for the order, which cannot take it (Reason, one of the
// Reject* constants); a refund follows as PaymentRefunded.
type PaymentRejected struct {
	OrderID           string    `json:"order_id"`
	PaymentID         uuid.UUID `json:"payment_id"`
	ProviderPaymentID string    `json:"provider_payment_id"`
	Amount            int64     `json:"amount"`
	Reason            string    `json:"reason"`
}

// PaymentExpired is the payload of a PaymentExpired event: the intent's
// deadline passed with no capture, so payment will take none; the order
// closes on it.
type PaymentExpired struct {
	OrderID   string    `json:"order_id"`
	IntentID  uuid.UUID `json:"intent_id"`
	PayBy     time.Time `json:"pay_by"`
	ExpiredAt time.Time `json:"expired_at"`
}

// PaymentRefunded is the payload of a PaymentRefunded event.
type PaymentRefunded struct {
	OrderID   string    `json:"order_id"`
	PaymentID uuid.UUID `json:"payment_id"`
	RefundID  uuid.UUID `json:"refund_id"`
	Amount    int64     `json:"amount"`
}

// ConsumerName is the durable name of payment's ORDERS consumer.
const ConsumerName = "payment-orders"

// orderEvent holds the fields payment reads from any ORDERS event; the
// payloads carry more, which a tolerant reader ignores.
type orderEvent struct {
	OrderID   string     `json:"order_id"`
	Total     *int64     `json:"total"`  // OrderCreated
	Amount    *int64     `json:"amount"` // OrderPaid, RefundRequested
	PayBy     *time.Time `json:"pay_by"` // OrderAwaitingPayment, OrderPaymentOverdue
	PaymentID string     `json:"payment_id"`
	Reason    string     `json:"reason"`
}

// The ORDERS events that tell payment the order's deadline: the first when
// the order enters WAIT_PAY, the second the order's safety net, sent long
// after pay_by while payment has not yet said whether it was paid.
const (
	typeAwaitingPayment = "OrderAwaitingPayment"
	typePaymentOverdue  = "OrderPaymentOverdue"
)

// handledTypes are the ORDERS events payment acts on (inbox
// Config.Handles); the others (OrderCompleted) only advance the
// aggregate's cursor: the intent is open from OrderCreated on.
var handledTypes = []string{"OrderCreated", typeAwaitingPayment, typePaymentOverdue, "OrderPaid", "OrderClosed", "OrderRejected", "RefundRequested"}

// typeRefundRequested is the one event whose handling reads before it
// writes.
const typeRefundRequested = "RefundRequested"

// readOrderEvent reads and checks an ORDERS event of a handled type: what
// breaks the contract is poison. The amount an event needs (Total or
// Amount) is there when it returns nil.
func readOrderEvent(m inbox.Message) (orderEvent, error) {
	var ev orderEvent
	if m.SchemaVersion != 1 {
		return ev, inbox.Poison(fmt.Errorf("%s schema version %d is not supported", m.Type, m.SchemaVersion))
	}
	if err := json.Unmarshal(m.Data, &ev); err != nil {
		return ev, inbox.Poison(fmt.Errorf("decode %s: %w", m.Type, err))
	}
	if ev.OrderID == "" {
		return ev, inbox.Poison(fmt.Errorf("%s without order_id", m.Type))
	}
	need := func(name string, v *int64) error {
		if v == nil || *v < 0 {
			return inbox.Poison(fmt.Errorf("%s without a valid %s", m.Type, name))
		}
		return nil
	}
	switch m.Type {
	case "OrderCreated":
		return ev, need("total", ev.Total)
	case "OrderPaid", typeRefundRequested:
		return ev, need("amount", ev.Amount)
	case typeAwaitingPayment, typePaymentOverdue:
		if ev.PayBy == nil || ev.PayBy.IsZero() {
			return ev, inbox.Poison(fmt.Errorf("%s without pay_by", m.Type))
		}
	}
	return ev, nil
}

// queueIntent queues on b the writes by which an ORDERS event other than
// RefundRequested moves its order's payment intent: one statement, and for
// OrderCreated the PaymentOpened that announces the intent it opens. None
// of them reads first, so a batch of them goes in one round trip.
func (s *Service) queueIntent(ctx context.Context, b *pgx.Batch, typ string, ev orderEvent) error {
	switch typ {
	case "OrderCreated":
		id, err := uuid.NewV7()
		if err != nil {
			return fmt.Errorf("new intent id: %w", err)
		}
		b.Queue(openIntentSQL, ev.OrderID, id, *ev.Total, traceHeaders(ctx))
		return s.outbox.Queue(ctx, b, orderEventOf(ev.OrderID, EventPaymentOpened, s.cfg.Now(), PaymentOpened{
			OrderID: ev.OrderID, IntentID: id, Amount: *ev.Total,
		}))
	case typeAwaitingPayment, typePaymentOverdue:
		b.Queue(learnDeadlineSQL, ev.OrderID, *ev.PayBy)
		if !s.cfg.Now().Before(*ev.PayBy) {
			// Heard late (a lagging consumer, or the order's safety net):
			// the expiry loop takes it once this commits.
			s.kickExpiry()
		}
	case "OrderPaid":
		b.Queue(markPaidSQL, ev.OrderID, *ev.Amount)
	case "OrderClosed", "OrderRejected":
		b.Queue(markClosedSQL, ev.OrderID)
	default:
		// A type handledTypes declares without a case here is a defect,
		// never a quiet close of the intent (TestEveryHandledTypeHasACase).
		return fmt.Errorf("services/payment/events.go: queueIntent has no case for %s, which handledTypes declares", typ)
	}
	return nil
}

// handle is the consumer's inbox Config.Handler: the intent writes of a
// batch's events go out in one round trip instead of one each. A RefundRequested reads its payment
// before it writes, so what is queued before it is sent first: every
// statement runs in stream order and sees what the events before it
// wrote. Any error fails the batch, and the inbox applies it again one
// event at a time.
func (s *Service) handle(ctx context.Context, tx pgx.Tx, batch []inbox.Batched) error {
	b := &pgx.Batch{}
	flush := func() error {
		if b.Len() == 0 {
			return nil
		}
		err := tx.SendBatch(ctx, b).Close()
		b = &pgx.Batch{}
		if err != nil {
			return fmt.Errorf("write the intents of a batch: %w", err)
		}
		return nil
	}
	for _, e := range batch {
		if !slices.Contains(handledTypes, e.Type) {
			continue // never reached through the consumer, which records other types without calling a handler (Config.Handles)
		}
		ev, err := readOrderEvent(e.Message)
		if err != nil {
			return err
		}
		if e.Type == typeRefundRequested {
			if err := flush(); err != nil {
				return err
			}
			if err := s.requestRefund(e.Ctx, tx, e.EventID, ev, *ev.Amount); err != nil {
				return err
			}
			continue
		}
		if err := s.queueIntent(e.Ctx, b, e.Type, ev); err != nil {
			return err
		}
	}
	return flush()
}

// requestRefund records the refund in the inbox transaction; the provider
// is called later by the refund loop, outside any transaction, because a
// transaction must never wait on a remote call.
func (s *Service) requestRefund(ctx context.Context, tx pgx.Tx, eventID uuid.UUID, ev orderEvent, amount int64) error {
	paymentID, err := uuid.Parse(ev.PaymentID)
	if err != nil {
		return inbox.Poison(fmt.Errorf("RefundRequested payment_id %q: %w", ev.PaymentID, err))
	}
	p, err := paymentByID(ctx, tx, paymentID)
	switch {
	case errors.Is(err, ErrNotFound):
		// The saga only asks about payments it heard of from us, and
		// our payment row commits before its event: this cannot heal.
		return inbox.Poison(fmt.Errorf("RefundRequested for unknown payment %s", paymentID))
	case err != nil:
		return err
	case p.OrderID != ev.OrderID || p.Status != StatusSucceeded || amount == 0 || amount > p.Amount:
		return inbox.Poison(fmt.Errorf("RefundRequested does not match payment %s (order %s, %s, amount %d)",
			paymentID, p.OrderID, p.Status, p.Amount))
	}
	refundID, err := uuid.NewV7()
	if err != nil {
		return fmt.Errorf("new refund id: %w", err)
	}
	created, err := insertRefund(ctx, tx, Refund{
		RefundID:       refundID,
		OrderID:        ev.OrderID,
		PaymentID:      paymentID,
		IdempotencyKey: eventID, // stable across redeliveries: the provider refunds once per key
		Amount:         amount,
	})
	if err != nil {
		return err
	}
	if created {
		s.log.Info("refund requested", "order_id", ev.OrderID, "payment_id", paymentID, "amount", amount, "reason", ev.Reason)
		s.kickRefunds()
	} else {
		s.log.Info("refund already requested for payment", "order_id", ev.OrderID, "payment_id", paymentID)
	}
	return nil
}

// paymentEvent is the outbox event of an accepted callback.
func paymentEvent(p Payment, at time.Time) outbox.Event {
	if p.Status == StatusSucceeded {
		return orderEventOf(p.OrderID, EventPaymentSucceeded, at, PaymentSucceeded{
			OrderID: p.OrderID, PaymentID: p.PaymentID, ProviderPaymentID: p.ProviderPaymentID, Amount: p.Amount,
		})
	}
	return orderEventOf(p.OrderID, EventPaymentFailed, at, PaymentFailed{
		OrderID: p.OrderID, PaymentID: p.PaymentID, ProviderPaymentID: p.ProviderPaymentID, Amount: p.Amount,
		// The callback carries no reason; the provider only said no.
		Reason: "declined",
	})
}

// rejectedEvent is the outbox event of a success that cannot be applied.
// The order saga does not handle it (its consumer only advances the
// cursor): it is the fact's record, for verify, shop trace and any reader.
func rejectedEvent(p Payment, at time.Time) outbox.Event {
	return orderEventOf(p.OrderID, EventPaymentRejected, at, PaymentRejected{
		OrderID: p.OrderID, PaymentID: p.PaymentID, ProviderPaymentID: p.ProviderPaymentID, Amount: p.Amount, Reason: p.RejectReason,
	})
}

// expiredEvent is the outbox event of an intent whose deadline passed.
func expiredEvent(in Intent, at time.Time) outbox.Event {
	var payBy time.Time
	if in.PayBy != nil {
		payBy = in.PayBy.UTC()
	}
	return orderEventOf(in.OrderID, EventPaymentExpired, at, PaymentExpired{
		OrderID: in.OrderID, IntentID: in.IntentID, PayBy: payBy, ExpiredAt: at.UTC(),
	})
}

func refundedEvent(r Refund, at time.Time) outbox.Event {
	return orderEventOf(r.OrderID, EventPaymentRefunded, at, PaymentRefunded{
		OrderID: r.OrderID, PaymentID: r.PaymentID, RefundID: r.RefundID, Amount: r.Amount,
	})
}

// orderEventOf builds an event of the order aggregate; the service's writer
// publishes it on the contract's subject payment.<order_id>.<Type>.
func orderEventOf(orderID, typ string, at time.Time, payload any) outbox.Event {
	return outbox.Event{
		AggregateType: "order",
		AggregateID:   orderID,
		Type:          typ,
		SchemaVersion: 1,
		Payload:       payload,
		OccurredAt:    at,
	}
}
