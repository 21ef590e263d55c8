package inventory

import "github.com/shop-ref/shop/internal/registry"

// Registration declares the inventory service to the shop (services.All).
var Registration = registry.Entry{
	Name:      "inventory",
	Schema:    "inventory",
	Stream:    "INVENTORY",
	Prefix:    Prefix,
	Addr:      ":8082",
	PoolSize:  8, // the consumer's 2 workers plus two, the relay's three, HTTP
	Consumers: []registry.Consumer{ordersConsumer},
	Configure: configure,
	Facts: []registry.Fact{
		{What: "reservation", SQL: `SELECT order_id AS key, 1 AS n FROM reservations WHERE created_at > $1 GROUP BY 1`,
			EventType: "InventoryReserved", EventKey: "aggregate_id"},
		{What: "release", SQL: `SELECT order_id AS key, 1 AS n FROM reservations WHERE state = 'RELEASED' AND updated_at > $1 GROUP BY 1`,
			EventType: "InventoryReleased", EventKey: "aggregate_id"},
		{What: "sale", SQL: `SELECT order_id AS key, 1 AS n FROM reservations WHERE state = 'COMMITTED' AND updated_at > $1 GROUP BY 1`,
			EventType: "InventoryCommitted", EventKey: "aggregate_id"},
	},
	Checks: []registry.Check{
		{Invariant: 4, Name: "stock is conserved (on_hand + sold = supplied, 0 ≤ reserved ≤ on_hand)", SQL: `
			SELECT sku || ': on_hand ' || on_hand || ', reserved ' || reserved || ', sold ' || sold || ', supplied ' || supplied
			FROM stock WHERE on_hand + sold <> supplied OR reserved < 0 OR reserved > on_hand`},
		{Invariant: 4, Name: "reserved equals what open reservations hold", SQL: `
			SELECT s.sku || ': reserved ' || s.reserved || ' but reservations hold ' || coalesce(h.held, 0)
			FROM stock s LEFT JOIN (SELECT sku, sum(quantity) AS held FROM reservations
			                        WHERE state = 'RESERVED' GROUP BY sku) h ON h.sku = s.sku
			WHERE s.reserved <> coalesce(h.held, 0)`},
		{Invariant: 4, Name: "orders whose saga has ended hold no reserved stock",
			From: &registry.Query{Service: "order", SQL: `SELECT order_id::text FROM orders WHERE status IN ('REJECTED', 'CLOSED', 'COMPLETED')`},
			SQL: `SELECT order_id || ' still holds ' || quantity || ' of ' || sku FROM reservations
			      WHERE state = 'RESERVED' AND order_id = ANY($1)`},
	},
}

// ordersConsumer reads the order events that reserve, release and sell
// stock.
var ordersConsumer = registry.Consumer{Name: ConsumerName, Stream: OrdersStream, Handles: handledTypes, Saga: true}

// Prefix is the first token of the inventory service's subjects:
// inventory.<order id or SKU>.<type>.
const Prefix = "inventory"

// configure declares the inventory service's settings.
func configure(env *registry.Env) registry.NewFunc {
	var cfg Config
	env.Secret(&cfg.OperatorToken, "OPERATOR_TOKEN", "", "bearer `token` the operator endpoints require, PUT /stock/{sku}; empty: open")
	return func(d registry.Deps) (registry.Domain, error) {
		if cfg.OperatorToken == "" {
			d.Log().Warn("OPERATOR_TOKEN is not set: PUT /stock/{sku}, an operator's restock, is open to anyone who reaches the inventory service; set one outside the demo")
		}
		return New(d, cfg)
	}
}
