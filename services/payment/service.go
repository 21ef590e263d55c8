// Package payment is the payment service: it opens an order's payment
// intent when it reads OrderCreated and announces it (PaymentOpened), follows
// the intent through the order events, accepts the provider's signed
// callbacks, emits PaymentSucceeded / PaymentFailed, and refunds through the
// provider when the order saga asks, exactly once even when the provider's
// answer is lost. A success it cannot apply to its order (another amount, an
// order it does not know, an intent that no longer takes one) is recorded
// as rejected (PaymentRejected) and refunded the same way, without the saga.
//
// The order saga shows an order as WAIT_PAY only after it has heard
// PaymentOpened, so an intent is open here whenever a client is told to
// pay: a payment made at that instant is applied, never refused.
//
// Payment owns the payment deadline. It learns the order's pay_by from
// OrderAwaitingPayment and decides, under the intent's row lock, whether a
// capture came in time; at pay_by it expires an unpaid intent
// (PaymentExpired), and the order closes on that word. So a capture payment
// answers "succeeded" is the order's payment however long its event takes
// to reach the order.
package payment

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Errors of the payment domain; http.go maps them to problems.
var (
	ErrNotFound        = errors.New("payment: order not known")
	ErrAmountMismatch  = errors.New("payment: amount differs from the order total")
	ErrPaymentConflict = errors.New("payment: provider payment id already recorded with other details")
	// The intent no longer takes a payment: its deadline passed, it was
	// closed (declined, or the order closed), or it was paid already.
	ErrWindowClosed = errors.New("payment: the payment window closed (pay_by passed)")
	ErrIntentClosed = errors.New("payment: the order no longer takes a payment")
	ErrAlreadyPaid  = errors.New("payment: the order is paid already")
)

// Config is the payment service's own settings (its Registration declares
// the variables of the first two), and what tests replace.
type Config struct {
	WebhookSecret string // HMAC key of provider callbacks (PAYMENT_WEBHOOK_SECRET); required
	// Simulate serves POST /payments/{order_id}/simulate, which has the
	// fake provider charge an order and sign its callback: a demo's
	// stand-in for a customer paying (PAYMENT_FAKE_PROVIDER). Default off:
	// a process facing a real provider must not let any client mint
	// signed "succeeded" callbacks for any order.
	Simulate bool
	// CaptureGrace (PAYMENT_CAPTURE_GRACE) is how long after an intent's
	// pay_by a payment that arrived before it may still be decided (it
	// waited for a connection or the intent's lock under load); the
	// intent expires once it has passed. Default DefaultCaptureGrace.
	CaptureGrace time.Duration
	Provider     *FakeProvider    // nil: a new FakeProvider
	Now          func() time.Time // nil: time.Now; tests move the clock to expire signatures
}

// DefaultCaptureGrace is Config.CaptureGrace's default: as long as a
// service may take to answer (app.WriteTimeout); a client still waiting
// after that has given up.
const DefaultCaptureGrace = 30 * time.Second

// Service is the payment service. Its HTTP handlers are mounted by Routes;
// its consumer, expiry loop and refund loop run in Run.
type Service struct {
	pool     *pgxpool.Pool
	cfg      Config
	log      *slog.Logger
	hooks    registry.Hooks
	provider *FakeProvider
	outbox   *outbox.Writer
	consumer *inbox.Consumer
	tracer   trace.Tracer  // the callbacks' spans
	kick     chan struct{} // wakes the refund loop; capacity 1, so kicks coalesce

	expiryKick chan struct{} // wakes the expiry loop, as kick the refund loop
	expiryPoll time.Duration // the longest the expiry loop sleeps

	refundPoll      time.Duration // how often the refund loop looks for due refunds
	refundCall      time.Duration // time limit of one provider call
	refundBackoff   time.Duration // first retry delay after a failed call; doubles per attempt
	refundBackoffMx time.Duration // cap of that delay
}

// New returns the payment service over d (its pool's search_path is the
// payment schema; the ORDERS stream must exist when Run starts). It does no
// I/O.
func New(d registry.Deps, cfg Config) (*Service, error) {
	if d.Pool == nil || d.JetStream == nil {
		return nil, errors.New("payment: New needs a pool and a JetStream context")
	}
	if cfg.WebhookSecret == "" {
		return nil, errors.New("payment: Config.WebhookSecret is required")
	}
	if cfg.Provider == nil {
		cfg.Provider = NewFakeProvider()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.CaptureGrace < 0 {
		return nil, fmt.Errorf("payment: Config.CaptureGrace %s is negative", cfg.CaptureGrace)
	}
	cfg.CaptureGrace = cmp.Or(cfg.CaptureGrace, DefaultCaptureGrace)
	tp := d.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	s := &Service{
		tracer:   tp.Tracer("github.com/shop-ref/shop/services/payment"),
		pool:     d.Pool,
		cfg:      cfg,
		log:      d.Log(),
		hooks:    d.Hooks,
		provider: cfg.Provider,
		// Coalesced wake-ups: the relay drains everything committed so far
		// on each one, and polls anyway.
		outbox:          &outbox.Writer{Prefix: Prefix, NotifyInterval: 5 * time.Millisecond},
		kick:            make(chan struct{}, 1),
		expiryKick:      make(chan struct{}, 1),
		expiryPoll:      time.Second,
		refundPoll:      time.Second,
		refundCall:      5 * time.Second,
		refundBackoff:   time.Second,
		refundBackoffMx: time.Minute,
	}
	ic := d.Inbox(ordersConsumer, s.handle)
	ic.Workers = consumerWorkers(d.Pool)
	c, err := inbox.NewConsumer(d.Pool, d.JetStream, ic)
	if err != nil {
		return nil, fmt.Errorf("payment consumer: %w", err)
	}
	s.consumer = c
	return s, nil
}

// Consumers returns the service's inbox consumers, for their counters and
// lag; Run runs them.
func (s *Service) Consumers() []*inbox.Consumer { return []*inbox.Consumer{s.consumer} }

// consumerWorkers sizes the consumer to the pool: the inbox needs
// Workers+2 connections, and a pool smaller than the shop's (pgx's default
// is four on a small machine) would otherwise be outrun by the workers.
func consumerWorkers(pool *pgxpool.Pool) int {
	return max(1, min(registry.ConsumerWorkers, int(pool.Config().MaxConns)-2))
}

// Run consumes the ORDERS stream, expires intents at their deadline and
// retries open refunds until ctx ends, then returns nil. The outbox relay
// is not part of it: the process runs one per schema.
func (s *Service) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return s.consumer.Run(ctx) })
	g.Go(func() error { return s.runExpiry(ctx) })
	g.Go(func() error { return s.runRefunds(ctx) })
	return g.Wait()
}

// recordCallback applies a verified, well-formed provider callback: it
// records the payment and its event in one transaction, or finds it
// recorded already (a replay) and changes nothing. A success that cannot be
// applied to its order is recorded as rejected, with its refund (see
// recordCallbackTx).
//
// rc says when the callback arrived and whether a late one is refused.
func (s *Service) recordCallback(ctx context.Context, cb Callback, rc received) (p Payment, replayed bool, err error) {
	p, replayed, err = s.recordCallbackTx(ctx, cb, rc)
	if isUniqueViolation(err) {
		// A twin with the same provider payment id committed between our
		// check and our insert (possible only across orders, or for an
		// order payment does not know, since callbacks of one known order
		// take the intent lock): a second look sees it.
		p, replayed, err = s.recordCallbackTx(ctx, cb, rc)
	}
	return p, replayed, err
}

// received is how a callback came in.
type received struct {
	// at is when the request arrived: the moment a payment is made, which
	// the deadline is judged by (a request that waited for a connection
	// or a lock under load was still made in time).
	at time.Time
	// refuseLate: a success for an intent that no longer takes one writes
	// nothing and returns the reason's error, nothing captured. The fake
	// provider charging for simulate asks before it takes the money, as a
	// real provider refuses to charge an intent that was cancelled.
	refuseLate bool
}

// verdict says why cb, which arrived at rc.at, cannot be applied to in at
// now (nil: an order payment does not know), or "" when it can: the intent
// is PAYABLE, the callback arrived before its deadline (if payment has
// heard it) and is decided within grace after it, and the amount is the
// order's total. This is the one place the payment deadline is decided,
// under the intent's row lock: a capture it accepts is the order's payment
// however long its event takes to reach the order, and the intent cannot
// expire under it (the expiry loop takes an intent only grace after its
// deadline, under the same lock).
func verdict(in *Intent, cb Callback, arrived, now time.Time, grace time.Duration) string {
	switch {
	case in == nil:
		return RejectUnknownOrder
	case cb.Amount != in.Amount:
		return RejectAmountMismatch
	case in.State == StatePaid:
		return RejectAlreadyPaid
	case in.State == StateExpired, in.State == StatePayable && in.PayBy != nil &&
		(!arrived.Before(*in.PayBy) || !now.Before(in.PayBy.Add(grace))):
		return RejectWindowClosed
	case in.State != StatePayable:
		return RejectOrderClosed
	}
	return ""
}

// expiring tells whether in is open and due for expiry at now: its
// deadline and the grace after it have passed.
func expiring(in *Intent, now time.Time, grace time.Duration) bool {
	return in != nil && in.State == StatePayable && in.PayBy != nil && !now.Before(in.PayBy.Add(grace))
}

// refusals are the errors of a callback that writes nothing: a failure
// that cannot be applied, or a success refused before any money moved
// (received.refuseLate).
var refusals = map[string]error{
	RejectUnknownOrder:   ErrNotFound,
	RejectAmountMismatch: ErrAmountMismatch,
	RejectWindowClosed:   ErrWindowClosed,
	RejectOrderClosed:    ErrIntentClosed,
	RejectAlreadyPaid:    ErrAlreadyPaid,
}

// late tells the reasons that say the intent no longer takes a payment,
// as opposed to a callback that could never apply.
func late(reason string) bool {
	return reason == RejectWindowClosed || reason == RejectOrderClosed || reason == RejectAlreadyPaid
}

func (s *Service) recordCallbackTx(ctx context.Context, cb Callback, rc received) (Payment, bool, error) {
	tx, in, recorded, traced, err := beginCallback(ctx, s.pool, cb)
	if err != nil {
		return Payment{}, false, err
	}
	// The provider's callback is a request from outside, in a trace of its
	// own (the HTTP span in ctx). What it settles belongs to the order's
	// trace, kept with the intent: a child of that, linked to the request,
	// and the event it writes carries it on.
	ctx, span := s.tracer.Start(traceContext.Extract(ctx, propagation.MapCarrier(traced)), "payment callback",
		trace.WithLinks(trace.LinkFromContext(ctx)),
		trace.WithAttributes(attribute.String("shop.order_id", cb.OrderID), attribute.String("shop.payment.status", cb.Status)))
	defer span.End()
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	// Replay first: a callback recorded once is answered the same way
	// whatever the order has done since (a rejected one stays rejected,
	// and is not refunded twice).
	if recorded != nil {
		if !recorded.answers(cb) {
			return Payment{}, false, ErrPaymentConflict
		}
		return *recorded, true, nil
	}
	// The clock is read again with the intent locked: no expiry can slip
	// in before the commit.
	now := s.cfg.Now()
	reason := verdict(in, cb, rc.at, now, s.cfg.CaptureGrace)
	switch {
	case reason != "" && cb.Status != StatusSucceeded && !late(reason):
		// No money moved, so there is nothing to keep or give back: the
		// callback is refused and writes nothing, and the provider may send
		// it again once it applies.
		return Payment{}, false, refusals[reason]
	case reason != "" && rc.refuseLate:
		return Payment{}, false, refusals[reason]
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Payment{}, false, fmt.Errorf("new payment id: %w", err)
	}
	p := Payment{
		PaymentID:         id,
		OrderID:           cb.OrderID,
		ProviderPaymentID: cb.ProviderPaymentID,
		Status:            cb.Status,
		Amount:            cb.Amount,
		CreatedAt:         now,
	}
	// The payment, its event, the intent's new state (and a rejected
	// payment's refund) travel in one round trip.
	b := &pgx.Batch{}
	if expiring(in, now, s.cfg.CaptureGrace) {
		// Due, and the expiry loop has not reached it yet: it expires here,
		// under the same lock, before the callback is recorded against it,
		// so the order hears the expiry first.
		b.Queue(setIntentStateSQL, in.OrderID, StateExpired)
		if err := s.outbox.Queue(ctx, b, expiredEvent(*in, now)); err != nil {
			return Payment{}, false, err
		}
	}
	ev := paymentEvent(p, now)
	var refund *Refund
	switch {
	case reason == "" && p.Status == StatusSucceeded:
		b.Queue(setIntentStateSQL, in.OrderID, StatePaid)
	case reason == "":
		// Declined: the order closes on PaymentFailed, so the intent closes
		// with it, here, and a capture after it is not answered succeeded.
		b.Queue(setIntentStateSQL, in.OrderID, StateClosed)
	case p.Status == StatusSucceeded:
		// Failure window: money the provider took that the order cannot
		// take (another amount, an unknown order, an intent past its
		// deadline, closed or paid already). It is recorded as rejected,
		// with a refund in the same transaction; the refund loop asks the
		// provider with the payment id as the idempotency key, so however
		// often the callback or the refund call is repeated, the money
		// goes back once. Until it has, verify and the reconciler report
		// it.
		p.Status, p.RejectReason = StatusRejected, reason
		ev = rejectedEvent(p, now)
		if p.Amount > 0 { // nothing was taken, nothing to give back
			refundID, err := uuid.NewV7()
			if err != nil {
				return Payment{}, false, fmt.Errorf("new refund id: %w", err)
			}
			refund = &Refund{RefundID: refundID, OrderID: p.OrderID, PaymentID: p.PaymentID,
				IdempotencyKey: p.PaymentID, Amount: p.Amount}
		}
	}
	// A failure for an intent that no longer takes payments is recorded
	// with its PaymentFailed and changes nothing: the order heard payment's
	// word (the capture, the expiry, the decline) before it.
	queueInsertPayment(b, p)
	if refund != nil {
		queueInsertRefund(b, *refund) // after the payment it references
	}
	if err := s.outbox.Queue(ctx, b, ev); err != nil {
		return Payment{}, false, err
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return Payment{}, false, fmt.Errorf("insert payment: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return Payment{}, false, fmt.Errorf("commit payment: %w", err)
	}
	if p.Status == StatusRejected {
		var total any // what the order costs, as far as payment knows
		if in != nil {
			total = in.Amount
		}
		s.log.Warn("payment rejected; refunding", "order_id", p.OrderID, "payment_id", p.PaymentID,
			"reason", reason, "amount", p.Amount, "order_total", total)
		s.kickRefunds()
		return p, false, nil
	}
	s.log.Info("payment recorded", "order_id", p.OrderID, "payment_id", p.PaymentID, "status", p.Status, "amount", p.Amount)
	return p, false, nil
}
