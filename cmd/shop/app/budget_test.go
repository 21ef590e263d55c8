package app_test

import (
	"testing"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/services"
)

// Two copies of every service, each its own process, with the reconciler,
// fit in a default Postgres: max_connections 100, of which 3 are kept for
// superusers (superuser_reserved_connections). docs/operating.md "Postgres
// connections" gives the figures and how to size for more copies.
func TestTwoCopiesOfEveryServiceFitADefaultPostgres(t *testing.T) {
	t.Parallel()
	const usable = 100 - 3
	if got := app.ConnectionBudget(services.All, 2); got > usable {
		t.Errorf("two copies of every service may open %d connections, more than %d", got, usable)
	}
	t.Logf("one copy of every service: at most %d connections; two: %d",
		app.ConnectionBudget(services.All, 1), app.ConnectionBudget(services.All, 2))
}
