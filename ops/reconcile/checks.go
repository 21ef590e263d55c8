package reconcile

import (
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// stuckOrders: each state's time is that of its first history entry (later
// entries with the same status are notes, e.g. a refund). WAIT_PAY's
// deadline is the earlier of its armed safety-net timeout and entry +
// PaymentTimeout (the pay_by the order promised, which payment keeps): an
// order still waiting Grace after it has not heard payment's word.
func (r *run) stuckOrders() error {
	rows, err := r.order.Query(r.ctx, `
		WITH cur AS (
			SELECT o.order_id::text AS id, o.status,
			       coalesce((SELECT min(h.at) FROM order_history h
			                 WHERE h.order_id = o.order_id AND h.status = o.status), o.created_at) AS since,
			       t.due_at
			FROM orders o
			LEFT JOIN saga_timeouts t ON t.saga_id = o.order_id::text AND t.name = 'payment'
			WHERE o.status IN ('PENDING', 'WAIT_PAY', 'PAID', 'FULFILLING'))
		SELECT id, status, now() - since, due_at IS NOT NULL FROM cur
		WHERE (status = 'PENDING' AND since < now() - $1 * interval '1 microsecond')
		   OR (status IN ('PAID', 'FULFILLING') AND since < now() - $2 * interval '1 microsecond')
		   OR (status = 'WAIT_PAY' AND least(due_at, since + $3 * interval '1 microsecond')
		                               < now() - $4 * interval '1 microsecond')
		ORDER BY since`,
		micros(r.cfg.Pending), micros(r.cfg.Paid), micros(r.cfg.PaymentTimeout), micros(r.cfg.Grace))
	if err != nil {
		return fmt.Errorf("reconcile: stuck orders: %w", err)
	}
	var id, status string
	var age time.Duration
	var timeout bool
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &age, &timeout}, func() error {
		detail := fmt.Sprintf("%s for %s", status, age.Round(time.Second))
		if status == "WAIT_PAY" {
			// Payment decides the deadline: past it, the order waits for
			// payment's PaymentExpired (or the capture it accepted).
			if timeout {
				detail += ", past its pay_by: payment has not said it expired or was paid (is the payment service running and reading ORDERS, and the order reading PAYMENT?)"
			} else {
				detail += ", past its pay_by, and the order's safety-net timeout is not armed"
			}
		}
		r.findings = append(r.findings, Finding{Kind: StuckOrder, OrderID: id, Detail: detail})
		return nil
	})
	if err != nil {
		return fmt.Errorf("reconcile: stuck orders: %w", err)
	}
	return nil
}

// unrefundedPayments pairs payment's succeeded payments without a refund
// with what the order saga knows of them.
func (r *run) unrefundedPayments() error {
	type captured struct{ PaymentID, OrderID string }
	rows, err := r.payment.Query(r.ctx, `
		SELECT p.payment_id::text, p.order_id FROM payments p
		WHERE p.status = 'succeeded' AND p.created_at < now() - $1 * interval '1 microsecond'
		  AND NOT EXISTS (SELECT 1 FROM refunds f WHERE f.payment_id = p.payment_id)
		ORDER BY p.created_at`, micros(r.cfg.Grace))
	if err != nil {
		return fmt.Errorf("reconcile: payments: %w", err)
	}
	payments, err := pgx.CollectRows(rows, pgx.RowToStructByPos[captured])
	if err != nil || len(payments) == 0 {
		return wrap("payments", err)
	}
	ids := make([]string, 0, len(payments))
	for _, p := range payments {
		ids = append(ids, p.OrderID)
	}
	type order struct {
		ID, Status, PaidBy string
		Refunded           []string
	}
	rows, err = r.order.Query(r.ctx, `
		SELECT o.order_id::text, o.status, coalesce(s.data->>'payment_id', ''),
		       coalesce(ARRAY(SELECT jsonb_array_elements_text(s.data->'refunded')), '{}')
		FROM orders o LEFT JOIN saga_instances s ON s.id = o.order_id::text
		WHERE o.order_id::text = ANY($1)`, ids)
	if err != nil {
		return fmt.Errorf("reconcile: orders of payments: %w", err)
	}
	orders, err := pgx.CollectRows(rows, pgx.RowToStructByPos[order])
	if err != nil {
		return fmt.Errorf("reconcile: orders of payments: %w", err)
	}
	byID := map[string]order{}
	for _, o := range orders {
		byID[o.ID] = o
	}
	for _, p := range payments {
		o, ok := byID[p.OrderID]
		switch {
		case !ok:
			r.findings = append(r.findings, Finding{Kind: UnrefundedPayment, OrderID: p.OrderID,
				Detail: fmt.Sprintf("payment %s succeeded for an order the order service does not know", p.PaymentID)})
		case o.PaidBy == p.PaymentID && slices.Contains([]string{"PAID", "FULFILLING", "COMPLETED"}, o.Status):
			// The payment that paid the order: nothing to refund.
		case slices.Contains(o.Refunded, p.PaymentID):
			r.findings = append(r.findings, Finding{Kind: UnrefundedPayment, OrderID: p.OrderID,
				Detail: fmt.Sprintf("payment %s: the order (%s) requested its refund, payment never recorded it", p.PaymentID, o.Status)})
		default:
			r.findings = append(r.findings, Finding{Kind: UnrefundedPayment, OrderID: p.OrderID,
				Detail: fmt.Sprintf("payment %s succeeded, order is %s, no refund requested", p.PaymentID, o.Status)})
		}
	}
	return nil
}

// heldReservations pairs inventory's open reservations with ended orders.
func (r *run) heldReservations() error {
	rows, err := r.inventory.Query(r.ctx, `
		SELECT DISTINCT order_id FROM reservations WHERE state = 'RESERVED'`)
	if err != nil {
		return fmt.Errorf("reconcile: reservations: %w", err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(held) == 0 {
		return wrap("reservations", err)
	}
	rows, err = r.order.Query(r.ctx, `
		SELECT order_id::text, status, now() - updated_at FROM orders
		WHERE order_id::text = ANY($1) AND status IN ('REJECTED', 'CLOSED', 'COMPLETED')
		  AND updated_at < now() - $2 * interval '1 microsecond'
		ORDER BY updated_at`, held, micros(r.cfg.Grace))
	if err != nil {
		return fmt.Errorf("reconcile: orders of reservations: %w", err)
	}
	var id, status string
	var age time.Duration
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &age}, func() error {
		r.findings = append(r.findings, Finding{Kind: HeldReservation, OrderID: id,
			Detail: fmt.Sprintf("stock still reserved, order %s for %s", status, age.Round(time.Second))})
		return nil
	})
	return wrap("orders of reservations", err)
}
