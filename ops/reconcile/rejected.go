package reconcile

import (
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// rejectedPayments reports payments the payment service recorded as
// rejected (money the provider took that the order could not take) whose
// refund is not done Config.Grace after they were recorded. The refund loop
// retries them by itself, with the same idempotency key, so there is
// nothing to republish: a finding here is for a person to look at a
// provider that keeps failing or refusing. They count as unrefunded
// payments.
func (r *run) rejectedPayments() error {
	rows, err := r.payment.Query(r.ctx, `
		SELECT p.order_id, p.payment_id::text, p.reject_reason, p.amount, now() - p.created_at,
		       coalesce(f.state, ''), coalesce(f.attempts, 0), coalesce(f.last_error, '')
		FROM payments p LEFT JOIN refunds f ON f.payment_id = p.payment_id
		WHERE p.status = 'rejected' AND p.amount > 0 AND f.state IS DISTINCT FROM 'DONE'
		  AND p.created_at < now() - $1 * interval '1 microsecond'
		ORDER BY p.created_at`, micros(r.cfg.Grace))
	if err != nil {
		return fmt.Errorf("reconcile: rejected payments: %w", err)
	}
	var order, payment, reason, state, lastErr string
	var amount int64
	var age time.Duration
	var attempts int
	_, err = pgx.ForEachRow(rows, []any{&order, &payment, &reason, &amount, &age, &state, &attempts, &lastErr}, func() error {
		detail := fmt.Sprintf("payment %s of %d was rejected (%s) %s ago and ", payment, amount, reason, age.Round(time.Second))
		if state == "" {
			detail += "has no refund"
		} else {
			detail += fmt.Sprintf("is not refunded after %d attempts (last error: %s; is the payment service's refund loop running, is the provider refusing?)",
				attempts, lastErr)
		}
		r.findings = append(r.findings, Finding{Kind: UnrefundedPayment, OrderID: order, Detail: detail})
		return nil
	})
	return wrap("rejected payments", err)
}
