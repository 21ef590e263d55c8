package shoptest_test

import (
	"bytes"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// TestSagaInBothRelayModes runs the whole shop once with every relay
// polling its outbox and once with every relay streaming it from a
// replication slot (RELAY_MODE=cdc), whatever RELAY_MODE the test process
// has, and takes one order through the whole saga in each: every event of
// all four services must reach its consumers and be applied once (shop
// verify's invariants). In cdc mode each service's slot must be there and
// streamed, so a relay that fell back to polling without a word (a
// database without wal_level=logical, say) fails the test instead of
// passing it in the wrong mode.
func TestSagaInBothRelayModes(t *testing.T) {
	for _, mode := range []outbox.Mode{outbox.ModePoll, outbox.ModeCDC} {
		t.Run(string(mode), func(t *testing.T) {
			shop := shoptest.StartWith(t, services.All, map[string]string{"RELAY_MODE": string(mode)})
			ctx := t.Context()
			u, err := url.Parse(shop.Env["DATABASE_URL"])
			if err != nil {
				t.Fatal(err)
			}
			dbName := strings.TrimPrefix(u.Path, "/")
			checked := verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{}}
			for _, e := range services.All {
				pool, err := database.NewPool(ctx, shop.Env["DATABASE_URL"], e.Schema, 1)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(pool.Close)
				checked.Pools[e.Name] = pool
			}

			shop.Restock(t, "SKU-MODE", 10, 500)
			id, _ := shop.Complete(t, "c-"+string(mode), "SKU-MODE", 2)

			// The slots of this shop's database, and whether a relay
			// streams each.
			slots := func() map[string]bool {
				rows, err := checked.Pools["order"].Query(ctx,
					`SELECT slot_name, active FROM pg_replication_slots WHERE database = $1`, dbName)
				if err != nil {
					t.Fatal(err)
				}
				defer rows.Close()
				got := map[string]bool{}
				for rows.Next() {
					var name string
					var active bool
					if err := rows.Scan(&name, &active); err != nil {
						t.Fatal(err)
					}
					got[name] = active
				}
				if err := rows.Err(); err != nil {
					t.Fatal(err)
				}
				return got
			}
			switch mode {
			case outbox.ModeCDC:
				poll.Until(t, 30*time.Second, "every service's slot streamed", func() bool {
					got := slots()
					for _, e := range services.All {
						if !got[outbox.SlotName(dbName, e.Schema)] {
							return false
						}
					}
					return true
				})
			case outbox.ModePoll:
				if got := slots(); len(got) > 0 {
					t.Errorf("polling relays made replication slots %v", got)
				}
			}

			report, err := verify.Wait(ctx, checked, app.OutboxRetention, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if !report.OK() {
				var b bytes.Buffer
				report.Write(&b)
				t.Fatalf("order %s in %s mode; shop verify:\n%s", id, mode, b.String())
			}
			// Every event the order made was marked published in its
			// outbox, whichever relay found it.
			for _, e := range services.All {
				poll.Until(t, 30*time.Second, e.Name+"'s outbox published", func() bool {
					var pending int
					err := checked.Pools[e.Name].QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&pending)
					return err == nil && pending == 0
				})
			}
		})
	}
}
