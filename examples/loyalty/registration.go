// Package loyalty is the fifth service of docs/adding-a-service.md, for
// real: it credits a customer one point per euro their completed orders
// kept (what they paid less what was refunded), serves
// GET /points/{customer} and publishes PointsAwarded. It reads two streams,
// ORDERS and PAYMENT, between which there is no order.
//
// It is not one of the shop's services: services.All lists it only in a
// build with the fifthservice tag (services/example_on.go), which `make
// test` runs the tests that know the service list with, so that one that
// assumed four services fails there. A fork copies it to services/loyalty/.
package loyalty

import (
	"embed"

	"github.com/shop-ref/shop/internal/registry"
)

// guide: registration
var Registration = registry.Entry{
	Name:   "loyalty",
	Schema: "loyalty",
	Stream: "LOYALTY",
	Prefix: prefix,
	// :8089, the last port the Dockerfile exposes: a fork's own fifth
	// service takes :8085, and the two can run side by side.
	Addr: ":8089",
	// Each consumer's Workers plus two (1+2, twice), the relay's three, one
	// for HTTP: docs/adding-a-service.md "The connection budget".
	PoolSize: 10,
	// A fork omits Migrations: its SQL is migrations/loyalty/*.sql, which
	// package migrations embeds by itself. The example lives outside
	// services/ and brings its own.
	Migrations: tables,
	Consumers:  []registry.Consumer{ordersConsumer, paymentConsumer},
	Configure:  configure,
	Facts: []registry.Fact{{What: "award", EventType: "PointsAwarded", EventKey: "payload->>'award_id'",
		SQL: `SELECT award_id::text AS key, 1 AS n FROM awards WHERE awarded_at > $1`}},
	Checks: []registry.Check{{Invariant: 4, Name: "each customer's points are the sum of their awards", SQL: `
		SELECT p.customer_id || ': ' || p.points || ' points, awards ' || coalesce(sum(a.points), 0)
		FROM points p LEFT JOIN awards a USING (customer_id)
		GROUP BY p.customer_id, p.points HAVING p.points <> coalesce(sum(a.points), 0)`}},
}

// prefix is the first token of the service's subjects: its stream's
// (loyalty.>) and those its outbox writer makes (<prefix>.<id>.<type>).
const prefix = "loyalty"

// ordersConsumer reads every order event, so that the inbox keeps each
// order's events in sequence (an OrderCompleted is never applied before its
// OrderCreated); it applies two types and only records the rest. Saga is
// false: a lagging loyalty service must never throttle POST /orders.
var ordersConsumer = registry.Consumer{Name: "loyalty-orders", Stream: "ORDERS",
	Handles: []string{"OrderCreated", "OrderCompleted"}}

// paymentConsumer reads every payment event, in each order's sequence on
// PAYMENT; nothing orders them against ORDERS' (see handle).
var paymentConsumer = registry.Consumer{Name: "loyalty-payment", Stream: "PAYMENT",
	Handles: []string{"PaymentSucceeded", "PaymentRefunded"}}

// configure declares the service's own setting and returns its constructor.
func configure(env *registry.Env) registry.NewFunc {
	var cfg Config
	env.Count(&cfg.CentsPerPoint, "LOYALTY_CENTS_PER_POINT", 100, "order total, in cents, that earns one point")
	return func(d registry.Deps) (registry.Domain, error) { return New(d, cfg) }
}

// guide: end registration

// tables is the service's SQL (00002_loyalty.sql).
//
//go:embed *.sql
var tables embed.FS
