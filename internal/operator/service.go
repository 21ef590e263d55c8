package operator

import (
	"slices"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/migrations"
)

// The one place this package knows which services there are and what each
// owns; every command goes through these.

// services lists every service, in start-up order.
func services() []string { return app.Names }

// schemaOf is the schema service owns ("order" owns "orders").
func schemaOf(service string) string { return migrations.Schemas[service] }

// serviceOf resolves a service or schema name ("order" or "orders").
func serviceOf(s string) (string, bool) {
	if slices.Contains(services(), s) {
		return s, true
	}
	for name, schema := range migrations.Schemas {
		if schema == s {
			return name, true
		}
	}
	return "", false
}

// verifyPools is pools (by service) as internal/verify takes them; a
// service without one is left nil.
func verifyPools(pools map[string]*pgxpool.Pool) verify.Pools {
	return verify.Pools{
		Order: pools["order"], Inventory: pools["inventory"], Payment: pools["payment"], Fulfillment: pools["fulfillment"],
	}
}
