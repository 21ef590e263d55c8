package fulfillment

import "github.com/shop-ref/shop/internal/registry"

// Registration declares the fulfillment service to the shop (services.All).
var Registration = registry.Entry{
	Name:      "fulfillment",
	Schema:    "fulfillment",
	Stream:    "FULFILLMENT",
	Prefix:    Prefix,
	Addr:      ":8084",
	PoolSize:  8, // the consumer's 2 workers plus two, the relay's three, the delivery scanner
	Consumers: []registry.Consumer{ordersConsumer},
	Configure: configure,
	Facts: []registry.Fact{
		{What: "shipment", SQL: `SELECT order_id::text AS key, 1 AS n FROM shipments WHERE started_at > $1`,
			EventType: "FulfillmentStarted", EventKey: "aggregate_id"},
		{What: "delivery", SQL: `SELECT order_id::text AS key, 1 AS n FROM shipments WHERE state = 'DELIVERED' AND delivered_at > $1`,
			EventType: "ShipmentDelivered", EventKey: "aggregate_id"},
	},
}

// ordersConsumer reads the paid orders. Fulfillment needs one event per
// order, OrderPaid, and nothing it does depends on the order of events:
// JetStream delivers only OrderPaid (which turns the per-aggregate sequence
// check off: it would need every event of the order). processed_events
// still absorbs every copy, and the shipment is keyed by order besides.
var ordersConsumer = registry.Consumer{Name: ConsumerName, Stream: "ORDERS", Types: []string{typeOrderPaid}, Saga: true}

// Prefix is the first token of the fulfillment service's subjects:
// fulfillment.<order id>.<type>.
const Prefix = "fulfillment"

// configure declares the fulfillment service's settings.
func configure(env *registry.Env) registry.NewFunc {
	var cfg Config
	env.Duration(&cfg.Delay, "FULFILLMENT_DELAY", DefaultDelay, "shipment start to delivery")
	return func(d registry.Deps) (registry.Domain, error) { return New(d, cfg) }
}
