package app

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/ops/verify"
)

// ShopPoolSize is the connections per schema of the reconciler's and the
// dashboard's pools: their queries run one after another, and what they
// hold counts against the connection budget (ConnectionBudget). The pools
// connect lazily, so a copy that does not hold the reconciler's lock opens
// none.
const ShopPoolSize = 1

// OpenShop opens a pool of conns connections on each service's schema of
// s, with the service's own database URL, for the operator's tools that read every
// schema (shop verify, the reconciler, the dashboard, shop outbox). The
// pools connect lazily, so opening them fails only on a URL that cannot be
// parsed. close releases them.
func OpenShop(ctx context.Context, s config.Schemas, conns int32) (shop verify.Shop, close func(), err error) {
	shop = verify.Shop{Services: s.Registry, Pools: make(map[string]*pgxpool.Pool, len(s.Registry))}
	close = func() {
		for _, p := range shop.Pools {
			p.Close()
		}
	}
	for _, e := range s.Registry {
		pool, err := database.NewPool(ctx, s.DatabaseURLOf(e.Name), e.Schema, conns)
		if err != nil {
			close()
			return verify.Shop{}, nil, fmt.Errorf("%s: %w", e.Name, err)
		}
		shop.Pools[e.Name] = pool
	}
	return shop, close, nil
}

// ConnectionBudget is the most Postgres connections copies copies of every
// service of reg may hold at once, each service its own process: every
// process's pool (Entry.PoolSize), the reconciler's lock connection in each
// process that runs the order service, and the reconciler's pools in the
// one copy that holds the lock. `shop all` adds the dashboard's pools
// (ShopPoolSize per schema) to its copy.
func ConnectionBudget(reg registry.Registry, copies int) int {
	n := 0
	for _, e := range reg {
		n += copies * int(e.PoolSize)
	}
	if _, err := reg.Get("order"); err == nil {
		n += copies + ShopPoolSize*len(reg)
	}
	return n
}

// DefaultUsableConnections is what a default Postgres lets the shop open:
// max_connections 100 less the 3 superuser_reserved_connections.
const DefaultUsableConnections = 100 - 3

// CopiesThatFit is how many copies of every service of reg, each its own
// process, fit in usable connections (ConnectionBudget): 0 when not even
// one does.
func CopiesThatFit(reg registry.Registry, usable int) int {
	n := 0
	for ConnectionBudget(reg, n+1) <= usable {
		n++
	}
	return n
}
