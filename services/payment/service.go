// Package payment is the payment service: it opens an order's payment
// intent when it reads OrderCreated and announces it (PaymentOpened), follows
// the intent through the order events, accepts the provider's signed
// callbacks, emits PaymentSucceeded / PaymentFailed, and refunds through the
// provider when the order saga asks, exactly once even when the provider's
// answer is lost. A success it cannot apply to its order (another amount, an
// order it does not know) is recorded as rejected (PaymentRejected) and
// refunded the same way, without the saga.
//
// The order saga shows an order as WAIT_PAY only after it has heard
// PaymentOpened, so an intent is open here whenever a client is told to
// pay: a payment made at that instant is applied, never refused.
package payment

import (
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
	Provider *FakeProvider    // nil: a new FakeProvider
	Now      func() time.Time // nil: time.Now; tests move the clock to expire signatures
}

// Service is the payment service. Its HTTP handlers are mounted by Routes;
// its consumer and refund loop run in Run.
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

// Run consumes the ORDERS stream and retries open refunds until ctx ends,
// then returns nil. The outbox relay is not part of it: the process runs one
// per schema.
func (s *Service) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return s.consumer.Run(ctx) })
	g.Go(func() error { return s.runRefunds(ctx) })
	return g.Wait()
}

// recordCallback applies a verified, well-formed provider callback: it
// records the payment and its event in one transaction, or finds it
// recorded already (a replay) and changes nothing. A success that cannot be
// applied to its order is recorded as rejected, with its refund (see
// recordCallbackTx).
func (s *Service) recordCallback(ctx context.Context, cb Callback) (p Payment, replayed bool, err error) {
	p, replayed, err = s.recordCallbackTx(ctx, cb)
	if isUniqueViolation(err) {
		// A twin with the same provider payment id committed between our
		// check and our insert (possible only across orders, or for an
		// order payment does not know, since callbacks of one known order
		// take the intent lock): a second look sees it.
		p, replayed, err = s.recordCallbackTx(ctx, cb)
	}
	return p, replayed, err
}

// unapplicable says why cb cannot be applied to in (nil: an order payment
// does not know), or "" when it can. Every state takes a payment of the
// right amount: the intent is open from the order's creation, and the order
// saga decides. It applies a success while the order waits for payment and
// turns one for an order that does not (not yet, or no longer) into a
// refund request.
func unapplicable(in *Intent, cb Callback) string {
	switch {
	case in == nil:
		return RejectUnknownOrder
	case cb.Amount != in.Amount:
		return RejectAmountMismatch
	}
	return ""
}

// refusals are the errors of a failed callback that cannot be applied.
var refusals = map[string]error{
	RejectUnknownOrder:   ErrNotFound,
	RejectAmountMismatch: ErrAmountMismatch,
}

func (s *Service) recordCallbackTx(ctx context.Context, cb Callback) (Payment, bool, error) {
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
	reason := unapplicable(in, cb)
	if reason != "" && cb.Status != StatusSucceeded {
		// No money moved, so there is nothing to keep or give back: the
		// callback is refused and writes nothing, and the provider may send
		// it again once it applies.
		return Payment{}, false, refusals[reason]
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Payment{}, false, fmt.Errorf("new payment id: %w", err)
	}
	now := s.cfg.Now()
	p := Payment{
		PaymentID:         id,
		OrderID:           cb.OrderID,
		ProviderPaymentID: cb.ProviderPaymentID,
		Status:            cb.Status,
		Amount:            cb.Amount,
		CreatedAt:         now,
	}
	// The payment and its event (and a rejected payment's refund) travel in
	// one round trip.
	b := &pgx.Batch{}
	ev := paymentEvent(p, now)
	var refund *Refund
	if reason != "" {
		// Failure window: money the provider took that the order cannot
		// take. Refused, as it once was, it stayed with the provider and
		// nothing here knew of it. It is recorded as rejected, with a
		// refund in the same transaction; the refund loop asks the
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
