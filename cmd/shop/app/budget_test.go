package app_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/services"
)

// The connection budget grows with the registry: every service's PoolSize
// counts, once per copy. One copy of every service, each its own process,
// with the reconciler, must fit in a default Postgres (max_connections 100,
// 3 kept for superusers) whatever the registry holds; the shop's own four
// services fit two copies. docs/operating.md "Postgres connections" gives
// the figures, docs/adding-a-service.md the lever (a consumer's Workers).
func TestEveryServiceFitsADefaultPostgres(t *testing.T) {
	t.Parallel()
	usable := app.DefaultUsableConnections
	if n := app.CopiesThatFit(services.All, usable); n < 1 {
		var pools []string
		for _, e := range services.All {
			pools = append(pools, fmt.Sprintf("%s %d", e.Name, e.PoolSize))
		}
		t.Errorf("one copy of every service may open %d connections, more than a default Postgres's %d (PoolSize: %s): "+
			"lower a consumer's Workers (each costs a connection; PoolSize is each consumer's Workers+2, the relay's 3 and room for HTTP), "+
			"or document the max_connections the shop needs (docs/adding-a-service.md, \"The connection budget\")",
			app.ConnectionBudget(services.All, 1), usable, strings.Join(pools, ", "))
	}
	// The shop as shipped: two copies, for a rolling restart on a default
	// Postgres (docs/operating.md). A fork's own service changes this
	// figure, not the check.
	var shop registry.Registry
	for _, name := range []string{"inventory", "order", "payment", "fulfillment"} {
		if e, err := services.All.Get(name); err == nil {
			shop = append(shop, e)
		}
	}
	if got := app.ConnectionBudget(shop, 2); got > usable {
		t.Errorf("two copies of the shop's own services may open %d connections, more than %d", got, usable)
	}
	t.Logf("every service: one copy at most %d connections, two %d; %d copies fit a default Postgres",
		app.ConnectionBudget(services.All, 1), app.ConnectionBudget(services.All, 2), app.CopiesThatFit(services.All, usable))
}

func TestCopiesThatFit(t *testing.T) {
	t.Parallel()
	reg := registry.Registry{{Name: "a", PoolSize: 10}, {Name: "b", PoolSize: 5}}
	for usable, want := range map[int]int{14: 0, 15: 1, 29: 1, 30: 2, 97: 6} {
		if got := app.CopiesThatFit(reg, usable); got != want {
			t.Errorf("CopiesThatFit(15 a copy, %d) = %d, want %d", usable, got, want)
		}
	}
}
