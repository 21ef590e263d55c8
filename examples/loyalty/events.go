package loyalty

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// guide: handler
// handle applies one event of either stream in the inbox's transaction. The
// inbox keeps each order's events in sequence within a stream, but nothing
// orders ORDERS against PAYMENT: a refund may be applied before the
// OrderCompleted, a payment before the OrderCreated. So each event only
// records what it says, under the order's row lock, and settle derives the
// order's points from everything recorded so far: whichever event comes
// last finishes the job, and any order of arrival ends in the same points.
func (s *Service) handle(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	// The order's row, made by whichever stream mentions it first, and
	// locked: the other stream's consumer waits here for this transaction.
	if _, err := tx.Exec(ctx, `INSERT INTO orders (order_id) VALUES ($1) ON CONFLICT DO NOTHING`, m.AggregateID); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `SELECT 1 FROM orders WHERE order_id = $1 FOR UPDATE`, m.AggregateID); err != nil {
		return err
	}
	var e struct {
		CustomerID string `json:"customer_id"`
		PaymentID  string `json:"payment_id"`
		Amount     int64  `json:"amount"`
	}
	if err := json.Unmarshal(m.Data, &e); err != nil {
		return inbox.Poison(fmt.Errorf("decode %s: %w", m.Type, err))
	}
	var err error
	switch m.Type {
	case "OrderCreated":
		_, err = tx.Exec(ctx, `UPDATE orders SET customer_id = $2 WHERE order_id = $1`, m.AggregateID, e.CustomerID)
	case "OrderCompleted":
		_, err = tx.Exec(ctx, `UPDATE orders SET completed = true WHERE order_id = $1`, m.AggregateID)
	case "PaymentSucceeded":
		_, err = tx.Exec(ctx, `INSERT INTO payments (payment_id, order_id, succeeded) VALUES ($1, $2, $3)
			ON CONFLICT (payment_id) DO UPDATE SET succeeded = excluded.succeeded`, e.PaymentID, m.AggregateID, e.Amount)
	case "PaymentRefunded":
		// A refund of a payment this service has not seen succeed yet (or
		// never will: a rejected payment's) counts nothing until it has.
		_, err = tx.Exec(ctx, `INSERT INTO payments (payment_id, order_id, refunded) VALUES ($1, $2, $3)
			ON CONFLICT (payment_id) DO UPDATE SET refunded = payments.refunded + excluded.refunded`, e.PaymentID, m.AggregateID, e.Amount)
	}
	if err != nil {
		return err
	}
	return s.settle(ctx, tx, m.AggregateID)
}

// settle brings the order's points to what its recorded events earn: one
// point per CentsPerPoint the customer paid and kept, once the order has
// completed. A change is an award (negative for a refund after the points
// were given) and its PointsAwarded, in the same transaction.
func (s *Service) settle(ctx context.Context, tx pgx.Tx, orderID string) error {
	var customer *string
	var completed bool
	var kept, awarded int64
	err := tx.QueryRow(ctx, `SELECT o.customer_id, o.completed,
		       (SELECT coalesce(sum(p.succeeded - p.refunded), 0) FROM payments p WHERE p.order_id = o.order_id AND p.succeeded IS NOT NULL),
		       (SELECT coalesce(sum(a.points), 0) FROM awards a WHERE a.order_id = o.order_id)
		FROM orders o WHERE o.order_id = $1`, orderID).Scan(&customer, &completed, &kept, &awarded)
	if err != nil {
		return fmt.Errorf("read order %s: %w", orderID, err)
	}
	if customer == nil || !completed {
		return nil // the rest of the order's events will settle it
	}
	delta := max(kept, 0)/s.cfg.CentsPerPoint - awarded
	if delta == 0 {
		return nil
	}
	var awardID int64
	if err := tx.QueryRow(ctx, `INSERT INTO awards (order_id, customer_id, points) VALUES ($1, $2, $3) RETURNING award_id`,
		orderID, *customer, delta).Scan(&awardID); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO points (customer_id, points) VALUES ($1, $2)
		ON CONFLICT (customer_id) DO UPDATE SET points = points.points + excluded.points`, *customer, delta); err != nil {
		return err
	}
	return s.outbox.Add(ctx, tx, outbox.Event{
		AggregateType: "order", AggregateID: orderID, Type: "PointsAwarded",
		Payload: map[string]any{"award_id": awardID, "order_id": orderID, "customer_id": *customer, "points": delta},
	})
}

// guide: end handler
