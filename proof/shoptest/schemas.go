package shoptest

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/pgtest"
)

// Schemas migrates a schema of its own for every service of reg (pgtest)
// and returns them as shop verify and the reconciler read them.
func Schemas(t testing.TB, reg registry.Registry) verify.Shop {
	t.Helper()
	shop := verify.Shop{Services: reg, Pools: make(map[string]*pgxpool.Pool, len(reg))}
	for _, e := range reg {
		shop.Pools[e.Name] = pgtest.New(t, e.Sets()...).Pool
	}
	return shop
}
