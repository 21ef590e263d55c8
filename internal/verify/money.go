package verify

// rejectedPayments checks the payments the payment service could not apply
// (status 'rejected': a success of another amount than the order's total,
// for an order whose stock was not held yet, or for an order it did not
// know): each has its PaymentRejected event (invariants 1 and 2), and each
// that took money has been given back (invariant 4: money the provider
// took is applied once or refunded once, never kept). A refund the provider
// has not completed yet (it is down, or refusing) is a violation until it
// has: verify.Wait waits for it like for an event in flight.
func (v *run) rejectedPayments() {
	v.pair("payment", "rejected payment", `SELECT payment_id::text AS key, 1 AS n FROM payments
		WHERE status = 'rejected' AND created_at > $1`, "PaymentRejected", "payload->>'payment_id'")
	v.check(4, "payment: every rejected payment is refunded", v.rows("payment", `
		SELECT p.order_id || ': rejected payment ' || p.payment_id || ' (' || p.reject_reason || ', ' || p.amount || ') '
		       || CASE WHEN r.refund_id IS NULL THEN 'has no refund'
		               ELSE 'is not refunded yet: ' || r.attempts || ' attempts, last error: ' || coalesce(r.last_error, 'none') END
		FROM payments p LEFT JOIN refunds r ON r.payment_id = p.payment_id
		WHERE p.status = 'rejected' AND p.amount > 0 AND r.state IS DISTINCT FROM 'DONE'
		ORDER BY p.created_at`))
}
