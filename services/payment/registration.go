package payment

import "github.com/shop-ref/shop/internal/registry"

// Registration declares the payment service to the shop (services.All).
var Registration = registry.Entry{
	Name:      "payment",
	Schema:    "payment",
	Stream:    "PAYMENT",
	Prefix:    Prefix,
	Addr:      ":8083",
	PoolSize:  9, // the consumer's 2 workers plus two, the relay's three, HTTP and refunds
	Consumers: []registry.Consumer{ordersConsumer},
	Configure: configure,
	Facts: []registry.Fact{
		{What: "opened intent", SQL: `SELECT order_id AS key, 1 AS n FROM intents WHERE opened_at > $1`,
			EventType: "PaymentOpened", EventKey: "aggregate_id"},
		{What: "expired intent", SQL: `SELECT order_id AS key, 1 AS n FROM intents WHERE state = 'EXPIRED' AND updated_at > $1`,
			EventType: "PaymentExpired", EventKey: "aggregate_id"},
		payments("succeeded", "PaymentSucceeded"),
		payments("failed", "PaymentFailed"),
		payments("rejected", "PaymentRejected"),
		{What: "refund", SQL: `SELECT refund_id::text AS key, 1 AS n FROM refunds WHERE state = 'DONE' AND updated_at > $1`,
			EventType: "PaymentRefunded", EventKey: "payload->>'refund_id'"},
	},
	Checks: []registry.Check{
		{Invariant: 4, Name: "no order is charged twice", SQL: `
			SELECT p.order_id || ': ' || count(*) || ' succeeded payments, ' || count(r.refund_id) || ' refunded'
			FROM payments p LEFT JOIN refunds r ON r.payment_id = p.payment_id AND r.state = 'DONE'
			WHERE p.status = 'succeeded' GROUP BY p.order_id
			HAVING count(*) - count(r.refund_id) > 1`},
		{Invariant: 4, Name: "every closed-but-paid order has exactly one refund per payment",
			From: &registry.Query{Service: "order", SQL: `SELECT order_id::text FROM orders WHERE status IN ('REJECTED', 'CLOSED')`},
			SQL: `SELECT p.order_id || ': payment ' || p.payment_id || ' has ' || count(r.refund_id) || ' completed refunds'
			      FROM payments p LEFT JOIN refunds r ON r.payment_id = p.payment_id AND r.state = 'DONE'
			      WHERE p.status = 'succeeded' AND p.order_id::text = ANY($1)
			      GROUP BY p.order_id, p.payment_id HAVING count(r.refund_id) <> 1`},
		// Payment owns the deadline: the order closes for it only on
		// payment's PaymentExpired, which an intent that took a capture
		// never gets. A payment answered "succeeded" whose order was closed
		// by the deadline is the customer told "paid" who lost the order.
		{Invariant: 4, Name: "no payment answered succeeded lost its order to the payment deadline",
			From: &registry.Query{Service: "order", SQL: `SELECT order_id::text FROM order_history WHERE status = 'CLOSED' AND reason = 'payment_timeout'`},
			SQL: `SELECT p.order_id || ': payment ' || p.payment_id || ' was answered succeeded at ' || p.created_at
			      || ', yet the order was closed by its payment deadline'
			      FROM payments p WHERE p.status = 'succeeded' AND p.order_id = ANY($1)`},
		// What an attacker who can publish an OrderPaid wants: goods out
		// without money in. Every shipment, and every unit sold, has a
		// succeeded payment of its order. The shipments and the sales are
		// read first (From), then the payments: a payment always commits
		// before the OrderPaid that ships or sells, so one read in between
		// is no false alarm. Each names the order and the event that
		// announced the shipment or the sale (while its outbox keeps it).
		{Invariant: 4, Name: "no shipment without a succeeded payment of its order",
			From: &registry.Query{Service: "fulfillment", SQL: `
			SELECT s.order_id::text || ' ' || coalesce((SELECT o.event_id::text FROM outbox o
			       WHERE o.aggregate_id = s.order_id::text AND o.event_type = 'FulfillmentStarted' LIMIT 1), '')
			FROM shipments s`},
			SQL: unpaid("shipped", "FulfillmentStarted")},
		{Invariant: 4, Name: "no stock sold without a succeeded payment of its order",
			From: &registry.Query{Service: "inventory", SQL: `
			SELECT r.order_id || ' ' || coalesce((SELECT o.event_id::text FROM outbox o
			       WHERE o.aggregate_id = r.order_id AND o.event_type = 'InventoryCommitted' LIMIT 1), '')
			FROM reservations r WHERE r.state = 'COMMITTED' GROUP BY r.order_id`},
			SQL: unpaid("sold stock", "InventoryCommitted")},
		// A payment the service could not apply (status 'rejected': a success
		// of another amount than the order's total, or for an order it did
		// not know) has its
		// PaymentRejected (Facts), and one that took money has been given
		// back: money the provider took is applied once or refunded once,
		// never kept. A refund the provider has not completed yet (it is
		// down, or refusing) is a violation until it has: verify.Wait waits
		// for it like for an event in flight.
		{Invariant: 4, Name: "every rejected payment is refunded", SQL: `
			SELECT p.order_id || ': rejected payment ' || p.payment_id || ' (' || p.reject_reason || ', ' || p.amount || ') '
			       || CASE WHEN r.refund_id IS NULL THEN 'has no refund'
			               ELSE 'is not refunded yet: ' || r.attempts || ' attempts, last error: ' || coalesce(r.last_error, 'none') END
			FROM payments p LEFT JOIN refunds r ON r.payment_id = p.payment_id
			WHERE p.status = 'rejected' AND p.amount > 0 AND r.state IS DISTINCT FROM 'DONE'
			ORDER BY p.created_at`},
	},
}

// ordersConsumer reads the order events that open, pay, close and refund
// payment intents.
var ordersConsumer = registry.Consumer{Name: ConsumerName, Stream: "ORDERS", Handles: handledTypes, Saga: true}

// Prefix is the first token of the payment service's subjects:
// payment.<order id>.<type>.
const Prefix = "payment"

// DefaultWebhookSecret is the demo's webhook key (PAYMENT_WEBHOOK_SECRET's
// default). Anyone who reads this repository can sign callbacks with it, so
// a service using it warns.
const DefaultWebhookSecret = "dev-secret"

// unpaid is the SQL of a check whose From gives "<order id> <event id>"
// (the event id empty once the outbox has deleted it): each order that has
// no succeeded payment, as "order <id>: <what> (<event type> <id>) without
// a succeeded payment".
func unpaid(what, eventType string) string {
	return `SELECT 'order ' || split_part(x, ' ', 1) || ': ` + what + ` (` + eventType + ` ' ||
	       coalesce(nullif(split_part(x, ' ', 2), ''), 'no longer in the outbox') || ') without a succeeded payment'
	FROM unnest($1::text[]) AS x
	WHERE NOT EXISTS (SELECT 1 FROM payments p WHERE p.order_id = split_part(x, ' ', 1) AND p.status = 'succeeded')
	ORDER BY 1`
}

// payments pairs the payments of one status with their event.
func payments(status, event string) registry.Fact {
	return registry.Fact{What: status + " payment", EventType: event, EventKey: "payload->>'payment_id'",
		SQL: `SELECT payment_id::text AS key, 1 AS n FROM payments WHERE status = '` + status + `' AND created_at > $1`}
}

// configure declares the payment service's settings.
func configure(env *registry.Env) registry.NewFunc {
	var cfg Config
	env.Secret(&cfg.WebhookSecret, "PAYMENT_WEBHOOK_SECRET", DefaultWebhookSecret, "HMAC `key` of payment callbacks")
	env.Bool(&cfg.Simulate, "PAYMENT_FAKE_PROVIDER", false, "serve POST /payments/{id}/simulate, the fake provider's demo payments")
	env.Duration(&cfg.CaptureGrace, "PAYMENT_CAPTURE_GRACE", DefaultCaptureGrace, "how long after pay_by a payment that arrived before it may still be decided; unpaid intents expire after it")
	return func(d registry.Deps) (registry.Domain, error) {
		if cfg.WebhookSecret == DefaultWebhookSecret {
			d.Log().Warn("PAYMENT_WEBHOOK_SECRET is the public demo default: anyone can forge payment callbacks; set your own outside the demo")
		}
		if cfg.Simulate {
			d.Log().Warn("PAYMENT_FAKE_PROVIDER is on: POST /payments/{id}/simulate lets any client have the fake provider pay any order; demo only")
		}
		return New(d, cfg)
	}
}
