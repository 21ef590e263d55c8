package app

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/verify"
)

// OpenShop opens a pool of conns connections on each service's schema, with
// the service's own database URL, for the operator's tools that read every
// schema (shop verify, the reconciler, the dashboard, shop outbox). The
// pools connect lazily, so opening them fails only on a URL that cannot be
// parsed. close releases them.
func OpenShop(ctx context.Context, cfg Config, conns int32) (shop verify.Shop, close func(), err error) {
	shop = verify.Shop{Services: cfg.Registry, Pools: make(map[string]*pgxpool.Pool, len(cfg.Registry))}
	close = func() {
		for _, p := range shop.Pools {
			p.Close()
		}
	}
	for _, e := range cfg.Registry {
		pool, err := database.NewPool(ctx, cfg.DatabaseURLOf(e.Name), e.Schema, conns)
		if err != nil {
			close()
			return verify.Shop{}, nil, fmt.Errorf("%s: %w", e.Name, err)
		}
		shop.Pools[e.Name] = pool
	}
	return shop, close, nil
}
