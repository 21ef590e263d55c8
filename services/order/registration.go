package order

import (
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/migrations"
)

// Registration declares the order service to the shop (services.All).
var Registration = registry.Entry{
	Name:      "order",
	Schema:    "orders",
	Stream:    "ORDERS",
	Prefix:    Prefix,
	Addr:      ":8081",
	PoolSize:  PoolSize + 4, // and the relay's workers plus one
	Libraries: []migrations.Set{migrations.Saga()},
	Consumers: consumers,
	Configure: configure,
	Facts:     facts,
}

// Prefix is the first token of the order service's subjects:
// orders.<order id>.<type>.
const Prefix = "orders"

// consumers are the saga's ears: what inventory, payment and fulfillment
// answer.
var consumers = []registry.Consumer{
	{Name: "order-inventory", Stream: "INVENTORY", Handles: append([]string{"ProductUpdated"}, inventoryOutcomes...), Saga: true},
	{Name: "order-payment", Stream: "PAYMENT", Handles: paymentOutcomes, Saga: true},
	{Name: "order-fulfillment", Stream: "FULFILLMENT", Handles: fulfillmentOutcomes, Saga: true},
}

// configure declares the order service's settings.
func configure(env *registry.Env) registry.NewFunc {
	var cfg Config
	env.Duration(&cfg.PaymentTimeout, "PAYMENT_TIMEOUT", DefaultPaymentTimeout, "how long an order may wait for payment")
	env.Duration(&cfg.PaymentOverdue, "ORDER_PAYMENT_OVERDUE", 0, "how long after pay_by an order payment has not settled asks payment again; default PAYMENT_TIMEOUT, a minute at least")
	env.Duration(&cfg.ReservationTimeout, "ORDER_RESERVATION_TIMEOUT", DefaultReservationTimeout, "how long an order may wait for inventory to reserve it and payment to open its intent")
	env.Duration(&cfg.FulfillmentTimeout, "ORDER_FULFILLMENT_TIMEOUT", DefaultFulfillmentTimeout, "how long a paid order may wait for its delivery before it is closed and refunded")
	env.Duration(&cfg.KeyTTL, "IDEMPOTENCY_KEY_TTL", DefaultKeyTTL, "how long Idempotency-Keys are remembered")
	env.Count(&cfg.MaxBacklog, "ORDER_MAX_BACKLOG", DefaultMaxBacklog, "saga events waiting for consumers above which POST /orders is 503; 0: never")
	return func(d registry.Deps) (registry.Domain, error) {
		c := cfg
		if c.MaxBacklog == 0 {
			c.MaxBacklog = -1 // the variable's 0 means never; Config's 0 means its default
		}
		return New(d, c)
	}
}

// facts pair each order and each transition with its event (shop verify).
var facts = []registry.Fact{
	{What: "order", SQL: `SELECT order_id::text AS key, 1 AS n FROM orders WHERE created_at > $1`,
		EventType: "OrderCreated", EventKey: "aggregate_id"},
	transition("WAIT_PAY", "OrderAwaitingPayment"),
	transition("REJECTED", "OrderRejected"),
	transition("PAID", "OrderPaid"),
	transition("CLOSED", "OrderClosed"),
	transition("COMPLETED", "OrderCompleted"),
}

// transition pairs the orders' entries into status with event. Entries that
// repeat the previous status (a refund noted in the history) are no
// transitions.
func transition(status, event string) registry.Fact {
	return registry.Fact{What: "transition to " + status, EventType: event, EventKey: "aggregate_id",
		SQL: `SELECT order_id::text AS key, count(*) AS n FROM (
				SELECT order_id, status, at, lag(status) OVER (PARTITION BY order_id ORDER BY id) AS before
				FROM order_history) h
			 WHERE status = '` + status + `' AND before IS DISTINCT FROM status AND at > $1 GROUP BY 1`}
}
