package payment

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
)

// DB is what the read functions need: a *pgxpool.Pool or a pgx.Tx.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Intent states. An intent is opened PAYABLE when payment reads the
// order's OrderCreated (openIntentSQL). What payment answers a callback
// moves it (a capture to PAID, a decline to CLOSED), and so does its
// deadline (EXPIRED); the order's events close it too.
const (
	StatePayable = "PAYABLE" // open: takes a payment of its amount until PayBy
	StatePaid    = "PAID"    // a capture was accepted
	StateClosed  = "CLOSED"  // declined, or the order closed or was rejected
	StateExpired = "EXPIRED" // PayBy passed with no capture (PaymentExpired)
)

// Payment statuses: the two a provider reports, and the one this service
// gives a success it cannot apply.
const (
	StatusSucceeded = "succeeded"
	StatusFailed    = "failed"
	// StatusRejected is money the provider took that cannot be applied to
	// the order (RejectReason says why): recorded, and refunded.
	StatusRejected = "rejected"
)

// Why a captured payment is rejected. (The table may also hold
// "not_payable", written by versions that refused orders whose stock was
// not held yet.)
const (
	RejectAmountMismatch = "amount_mismatch" // the amount differs from the order total
	RejectUnknownOrder   = "unknown_order"   // payment has not heard of the order
	RejectWindowClosed   = "window_closed"   // the intent's pay_by had passed (EXPIRED)
	RejectOrderClosed    = "order_closed"    // the intent was closed: declined, or the order closed
	RejectAlreadyPaid    = "already_paid"    // the intent had taken a capture already
)

// Refund states.
const (
	RefundRequested = "REQUESTED"
	RefundDone      = "DONE"
)

// Intent is what payment knows of an order.
type Intent struct {
	OrderID   string    `json:"order_id"`
	IntentID  uuid.UUID `json:"intent_id"` // announced in PaymentOpened, shown by the order
	State     string    `json:"state"`
	Amount    int64     `json:"amount"`
	UpdatedAt time.Time `json:"updated_at"`
	// PayBy is the deadline the order shows, learned from
	// OrderAwaitingPayment; nil until payment has read it.
	PayBy *time.Time `json:"pay_by,omitempty"`
}

// Payment is one recorded provider callback.
type Payment struct {
	PaymentID         uuid.UUID `json:"payment_id"`
	OrderID           string    `json:"order_id"`
	ProviderPaymentID string    `json:"provider_payment_id"`
	Status            string    `json:"status"`
	Amount            int64     `json:"amount"`
	CreatedAt         time.Time `json:"created_at"`
	RejectReason      string    `json:"reject_reason,omitempty"` // StatusRejected only
}

// answers tells whether cb is a replay of the callback p was recorded
// from: a rejected payment was a success.
func (p Payment) answers(cb Callback) bool {
	status := p.Status
	if status == StatusRejected {
		status = StatusSucceeded
	}
	return p.OrderID == cb.OrderID && status == cb.Status && p.Amount == cb.Amount
}

// Refund is one refund asked for by the order saga (its key is the
// RefundRequested event id), or of a rejected payment (its key is the
// payment id).
type Refund struct {
	RefundID         uuid.UUID `json:"refund_id"`
	OrderID          string    `json:"order_id"`
	PaymentID        uuid.UUID `json:"payment_id"`
	IdempotencyKey   uuid.UUID `json:"idempotency_key"`
	Amount           int64     `json:"amount"`
	State            string    `json:"state"`
	ProviderRefundID *string   `json:"provider_refund_id"`
	Attempts         int       `json:"attempts"`
	LastError        *string   `json:"last_error"`
}

const intentColumns = `order_id, intent_id, state, amount, updated_at, pay_by`

// getIntent reads orderID's intent, or returns ErrNotFound.
func getIntent(ctx context.Context, db DB, orderID string) (Intent, error) {
	var in Intent
	err := db.QueryRow(ctx, `SELECT `+intentColumns+` FROM intents WHERE order_id = $1`, orderID).
		Scan(&in.OrderID, &in.IntentID, &in.State, &in.Amount, &in.UpdatedAt, &in.PayBy)
	if errors.Is(err, pgx.ErrNoRows) {
		return in, ErrNotFound
	}
	if err != nil {
		return in, fmt.Errorf("read intent: %w", err)
	}
	return in, nil
}

const paymentColumns = `payment_id, order_id, provider_payment_id, status, amount, created_at, coalesce(reject_reason, '')`

func paymentByID(ctx context.Context, db DB, id uuid.UUID) (Payment, error) {
	return onePayment(ctx, db, `SELECT `+paymentColumns+` FROM payments WHERE payment_id = $1`, id)
}

func onePayment(ctx context.Context, db DB, q string, arg any) (Payment, error) {
	rows, _ := db.Query(ctx, q, arg)
	p, err := pgx.CollectExactlyOneRow(rows, pgx.RowToStructByPos[Payment])
	if errors.Is(err, pgx.ErrNoRows) {
		return p, ErrNotFound
	}
	if err != nil {
		return p, fmt.Errorf("read payment: %w", err)
	}
	return p, nil
}

// collectInto is a batch callback that collects a query's rows into *dst.
func collectInto[T any](dst *[]T) func(pgx.Rows) error {
	return func(rows pgx.Rows) error {
		var err error
		*dst, err = pgx.CollectRows(rows, pgx.RowToStructByPos[T])
		return err
	}
}

// beginCallback begins the transaction that records a callback and, in the
// same round trip, reads what the callback is checked against: its order's
// intent (nil if payment does not know the order) and the payment already
// recorded under its provider payment id (nil if none). The intent is read
// FOR UPDATE, which serializes callbacks of one order: a twin of a callback
// waits there, and the payment read, a statement of its own that takes its
// snapshot only once the lock is held, then finds the first one's payment
// (a replay). Twins for an unknown order have no row to wait on; the unique
// provider payment id stops the second (see recordCallback).
func beginCallback(ctx context.Context, pool *pgxpool.Pool, cb Callback) (tx pgx.Tx, in *Intent, recorded *Payment, trace map[string]string, err error) {
	var intents []Intent
	var payments []Payment
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(`SELECT `+intentColumns+` FROM intents WHERE order_id = $1 FOR UPDATE`, cb.OrderID).
		Query(collectInto(&intents))
	// The order's trace, kept when the intent opened: the callback continues it.
	b.Queue(`SELECT trace_headers FROM intents WHERE order_id = $1`, cb.OrderID).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			if err := rows.Scan(&trace); err != nil {
				return err
			}
		}
		return rows.Err()
	})
	b.Queue(`SELECT `+paymentColumns+` FROM payments WHERE provider_payment_id = $1`, cb.ProviderPaymentID).
		Query(collectInto(&payments))
	br := pool.SendBatch(ctx, b)
	tx = br.Tx()
	if err = br.Close(); err != nil {
		_ = tx.Rollback(ctx) // gives the connection back to the pool
		return nil, nil, nil, nil, fmt.Errorf("read intent and payment: %w", err)
	}
	if len(intents) > 0 {
		in = &intents[0]
	}
	if len(payments) > 0 {
		recorded = &payments[0] // provider_payment_id is unique
	}
	return tx, in, recorded, trace, nil
}

// orderView is what payment knows of an order: its intent, payments and
// refunds.
type orderView struct {
	Intent
	Payments []Payment `json:"payments"`
	Refunds  []Refund  `json:"refunds"`
}

// readOrderView reads orderID's intent, payments and refunds in one round
// trip, or returns ErrNotFound.
func readOrderView(ctx context.Context, pool *pgxpool.Pool, orderID string) (orderView, error) {
	var v orderView
	var intents []Intent
	b := &pgx.Batch{}
	b.Queue(`SELECT `+intentColumns+` FROM intents WHERE order_id = $1`, orderID).
		Query(collectInto(&intents))
	b.Queue(`SELECT `+paymentColumns+` FROM payments WHERE order_id = $1 ORDER BY created_at, payment_id`, orderID).
		Query(collectInto(&v.Payments))
	b.Queue(`SELECT `+refundColumns+` FROM refunds WHERE order_id = $1 ORDER BY created_at, refund_id`, orderID).
		Query(collectInto(&v.Refunds))
	if err := pool.SendBatch(ctx, b).Close(); err != nil {
		return orderView{}, fmt.Errorf("read intent, payments and refunds: %w", err)
	}
	if len(intents) == 0 {
		return orderView{}, ErrNotFound
	}
	v.Intent = intents[0]
	return v, nil
}

// queueInsertPayment queues into b the insert of p.
func queueInsertPayment(b *pgx.Batch, p Payment) {
	b.Queue(`
		INSERT INTO payments (payment_id, order_id, provider_payment_id, status, amount, created_at, reject_reason)
		VALUES ($1, $2, $3, $4, $5, $6, NULLIF($7, ''))`,
		p.PaymentID, p.OrderID, p.ProviderPaymentID, p.Status, p.Amount, p.CreatedAt, p.RejectReason)
}

// The intent writes below run in the inbox transaction of the ORDERS event
// that caused them. The inbox applies one order's events in sequence, so
// each write only guards against what cannot happen in order anyway: a
// state never moves back.

// The statements that move a payment intent, one per ORDERS event
// (queueIntent).
const (
	// OrderCreated opens the intent, and the same transaction announces it
	// (PaymentOpened): the order waits for that announcement, besides
	// inventory's reservation, before it shows WAIT_PAY. OrderCreated is
	// its order's first event, so the intent is new; were it not, the
	// stored id is made the announced one.
	openIntentSQL = `
		INSERT INTO intents (order_id, intent_id, state, amount, trace_headers, opened_at)
		VALUES ($1, $2, 'PAYABLE', $3, $4, now())
		ON CONFLICT (order_id) DO UPDATE SET intent_id = EXCLUDED.intent_id, opened_at = EXCLUDED.opened_at`
	// The capture moved the intent to PAID already; this only covers an
	// order payment never saw created.
	markPaidSQL = `
		INSERT INTO intents (order_id, state, amount) VALUES ($1, 'PAID', $2)
		ON CONFLICT (order_id) DO UPDATE SET state = 'PAID', updated_at = now()
		WHERE intents.state NOT IN ('PAID', 'CLOSED', 'EXPIRED')`
	// No amount in OrderClosed/OrderRejected: an order never seen stays
	// unknown, and its callbacks get 404. An expired intent stays EXPIRED:
	// the order closed because of it.
	markClosedSQL = `
		UPDATE intents SET state = 'CLOSED', updated_at = now()
		WHERE order_id = $1 AND state NOT IN ('CLOSED', 'EXPIRED')`
	// OrderAwaitingPayment (and the order's later OrderPaymentOverdue, which
	// repeats it) tells payment the deadline the order shows. The first
	// word stands: the order never moves it. A deadline already past is
	// expired by the next pass of the expiry loop.
	learnDeadlineSQL = `
		UPDATE intents SET pay_by = $2, updated_at = now()
		WHERE order_id = $1 AND pay_by IS NULL`
)

// setIntentStateSQL moves an intent locked by beginCallback to what the
// callback made of it.
const setIntentStateSQL = `UPDATE intents SET state = $2, updated_at = now() WHERE order_id = $1`

// expireDueSQL expires up to $2 open intents whose deadline is at or before
// $1 (now less Config.CaptureGrace) and returns them. It takes the intent rows FOR UPDATE, the lock a
// capture takes (beginCallback): an intent is either captured or expired,
// never both, whichever locks it first; SKIP LOCKED leaves an intent a
// capture holds to that capture (which sees the deadline itself) and the
// others to another copy of the service. An intent with a succeeded
// payment is never expired, even one recorded by a version that left the
// intent PAYABLE.
const expireDueSQL = `
	UPDATE intents i SET state = 'EXPIRED', updated_at = now()
	WHERE i.order_id IN (
		SELECT order_id FROM intents
		WHERE state = 'PAYABLE' AND pay_by IS NOT NULL AND pay_by <= $1
		ORDER BY pay_by
		LIMIT $2
		FOR UPDATE SKIP LOCKED)
	  AND NOT EXISTS (SELECT 1 FROM payments p WHERE p.order_id = i.order_id AND p.status = 'succeeded')
	RETURNING ` + intentColumns + `, trace_headers`

// insertRefundSQL records a requested refund. It does nothing when the
// payment already has one (the saga asked twice) or the key is known (a
// redelivered event): one payment is refunded at most once.
const insertRefundSQL = `
	INSERT INTO refunds (refund_id, order_id, payment_id, idempotency_key, amount, state)
	VALUES ($1, $2, $3, $4, $5, 'REQUESTED')
	ON CONFLICT DO NOTHING`

// insertRefund records a requested refund (insertRefundSQL) and reports
// whether it is new.
func insertRefund(ctx context.Context, tx pgx.Tx, r Refund) (bool, error) {
	tag, err := tx.Exec(ctx, insertRefundSQL, r.RefundID, r.OrderID, r.PaymentID, r.IdempotencyKey, r.Amount)
	if err != nil {
		return false, fmt.Errorf("insert refund: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// queueInsertRefund queues into b the insert of a requested refund
// (insertRefundSQL), for a transaction that sends its writes as one batch.
func queueInsertRefund(b *pgx.Batch, r Refund) {
	b.Queue(insertRefundSQL, r.RefundID, r.OrderID, r.PaymentID, r.IdempotencyKey, r.Amount)
}

const refundColumns = `refund_id, order_id, payment_id, idempotency_key, amount, state, provider_refund_id, attempts, last_error`

// claimRefunds takes up to limit due REQUESTED refunds, counts an attempt
// on each and pushes its next attempt lease into the future, all in one
// statement that commits at once: no lock is held during the provider call,
// and other instances skip these rows (SKIP LOCKED now, next_attempt_at
// after). If this process dies mid-call, the refund is due again when the
// lease ends.
func claimRefunds(ctx context.Context, db DB, limit int, lease time.Duration) ([]Refund, error) {
	rows, _ := db.Query(ctx, `
		UPDATE refunds SET attempts = attempts + 1,
		                   next_attempt_at = now() + make_interval(secs => $2),
		                   updated_at = now()
		WHERE refund_id IN (
			SELECT refund_id FROM refunds
			WHERE state = 'REQUESTED' AND next_attempt_at <= now()
			ORDER BY next_attempt_at
			LIMIT $1
			FOR UPDATE SKIP LOCKED)
		RETURNING `+refundColumns, limit, lease.Seconds())
	rs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Refund])
	if err != nil {
		return nil, fmt.Errorf("claim refunds: %w", err)
	}
	return rs, nil
}

// completeRefund marks a refund DONE. It reports false when the refund was
// DONE already (another instance finished it first), so that exactly one
// caller emits PaymentRefunded.
func completeRefund(ctx context.Context, tx pgx.Tx, refundID uuid.UUID, providerRefundID string) (bool, error) {
	tag, err := tx.Exec(ctx, `
		UPDATE refunds SET state = 'DONE', provider_refund_id = $2, last_error = NULL, updated_at = now()
		WHERE refund_id = $1 AND state = 'REQUESTED'`, refundID, providerRefundID)
	if err != nil {
		return false, fmt.Errorf("complete refund: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// failRefund records a failed or ambiguous attempt and when to try again.
func failRefund(ctx context.Context, db DB, refundID uuid.UUID, cause string, retryIn time.Duration) error {
	_, err := db.Exec(ctx, `
		UPDATE refunds SET last_error = $2, next_attempt_at = now() + make_interval(secs => $3), updated_at = now()
		WHERE refund_id = $1 AND state = 'REQUESTED'`, refundID, cause, retryIn.Seconds())
	if err != nil {
		return fmt.Errorf("record refund failure: %w", err)
	}
	return nil
}

func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

// traceContext is the W3C Trace Context propagator (the contract's
// traceparent).
var traceContext propagation.TraceContext

// traceHeaders is the trace context of ctx as headers, for a row that must
// carry it to a later transaction.
func traceHeaders(ctx context.Context) map[string]string {
	c := propagation.MapCarrier{}
	traceContext.Inject(ctx, c)
	return c
}
