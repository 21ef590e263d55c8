package verify_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// A Postgres that is there but full ("too many connections", as when other
// clients fill max_connections) is waited for like invariants still
// settling: Wait tries again until the server takes the checks, instead of
// failing on the first refused connection. The server is made full for a
// login role of the test's own with a connection limit, whose every slot
// the test holds until the checks have been refused once.
func TestWaitWaitsForAFullServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shop := shoptest.Schemas(t, services.All)
	admin := shop.Pools["order"]

	b := make([]byte, 6)
	_, _ = rand.Read(b)
	role := "verify_full_" + hex.EncodeToString(b)
	limit := len(shop.Pools) // one connection per service's pool, as the checks use them
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN CONNECTION LIMIT `+strconv.Itoa(limit)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The test's pools are closed first (cleanups run last-in first-out).
		if _, err := admin.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})

	var (
		mu       sync.Mutex
		held     []*pgx.Conn
		attempts int
	)
	release := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			_ = c.Close(context.Background())
		}
		held = nil
	}
	t.Cleanup(release)
	full := verify.Shop{Services: shop.Services, Pools: map[string]*pgxpool.Pool{}}
	for name, p := range shop.Pools {
		schema := p.Config().ConnConfig.RuntimeParams["search_path"]
		if _, err := admin.Exec(ctx, `GRANT USAGE ON SCHEMA `+schema+` TO `+role+`;
			GRANT SELECT ON ALL TABLES IN SCHEMA `+schema+` TO `+role); err != nil {
			t.Fatal(err)
		}
		cfg := p.Config().Copy()
		cfg.ConnConfig.User = role
		cfg.MaxConns, cfg.MinConns = 1, 0
		// The second connection attempt of the checks (the first was
		// refused: every slot is held) frees the slots.
		cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
			mu.Lock()
			attempts++
			n := attempts
			mu.Unlock()
			if n == 2 {
				release()
			}
			return nil
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		full.Pools[name] = pool
	}
	for range limit {
		cfg := shop.Pools["order"].Config().ConnConfig.Copy()
		cfg.User = role
		c, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		held = append(held, c)
		mu.Unlock()
	}

	report, err := verify.Wait(ctx, full, time.Hour, time.Minute)
	if err != nil {
		t.Fatalf("Wait on a server that was full for the first attempt: %v", err)
	}
	if !report.OK() {
		t.Fatalf("an empty shop violates invariants: %+v", report)
	}
	mu.Lock()
	defer mu.Unlock()
	if attempts < 2 {
		t.Fatalf("%d connection attempts: the full server was never met", attempts)
	}
}
