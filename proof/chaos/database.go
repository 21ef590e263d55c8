package chaos

import (
	"context"
	"os/exec"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/pgcluster"
	"github.com/shop-ref/shop/proof/pgtest"
)

// database creates a throwaway database, dropped at the end: on the
// shared test server, or, with the cdc lane, on a private cluster that
// the lane may restart (the shared server must never be) and whose
// replication slots go with it.
func (h *harness) database() {
	if !h.cfg.lane(LaneCDC) {
		db := pgtest.NewDatabase(h.t, "shop_chaos_")
		h.dbName, h.dbURL = db.Name, db.URL
		return
	}
	h.pg = pgcluster.Start(h.t, map[string]string{
		// Two copies of each service, and the harness: the shared
		// server's budget, with room.
		"max_connections":       "200",
		"max_replication_slots": "32",
		"max_wal_senders":       "32",
		// A relay killed or standing by must not lose its slot in a run.
		"max_slot_wal_keep_size": "2GB",
	})
	h.dbName = "shop_chaos"
	h.dbURL = h.pg.DatabaseURL(h.dbName)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := database.EnsureExists(ctx, h.dbURL); err != nil {
		h.t.Fatalf("chaos database on the private cluster: %v", err)
	}
	h.logf("chaos: the cdc lane's private Postgres at 127.0.0.1:%d (log %s)", h.pg.Port(), h.pg.LogPath())
}

// withAppName sets application_name in a database URL, so that one
// service's backends can be told apart in pg_stat_activity.
func withAppName(dbURL, name string) string {
	sep := "?"
	if strings.Contains(dbURL, "?") {
		sep = "&"
	}
	return dbURL + sep + "application_name=" + name
}

func (h *harness) migrate(ctx context.Context) {
	cmd := exec.CommandContext(ctx, h.bin, "migrate")
	cmd.Env = h.env(withAppName(h.dbURL, "chaos-migrate"), "")
	if out, err := cmd.CombinedOutput(); err != nil {
		h.t.Fatalf("shop migrate: %v\n%s", err, out)
	}
	admin, err := database.NewPool(ctx, withAppName(h.dbURL, "chaos-harness"), "public", 3)
	if err != nil {
		h.t.Fatal(err)
	}
	h.admin = admin
	if err := admin.Ping(ctx); err != nil { // one connection held from now on (see below)
		h.t.Fatal(err)
	}
	h.t.Cleanup(admin.Close)
	h.shop = verify.Shop{Services: h.cfg.Services, Pools: map[string]*pgxpool.Pool{}}
	for _, e := range h.cfg.Services {
		// One connection each: verify's queries run one at a time, and
		// Postgres's 100 connections are shared with the shop processes.
		p, err := database.NewPool(ctx, withAppName(h.dbURL, "chaos-verify"), e.Schema, 1)
		if err != nil {
			h.t.Fatal(err)
		}
		h.t.Cleanup(p.Close)
		// Connected now and kept: a Postgres server that other tests fill
		// up later must not leave the final checks without a connection.
		if err := p.Ping(ctx); err != nil {
			h.t.Fatal(err)
		}
		h.shop.Pools[e.Name] = p
	}
}

// fill puts old published events in fulfillment's outbox (one aggregate of
// its own, gap-free) for retention to delete in more than one batch.
func (h *harness) fill(ctx context.Context) {
	s := h.schema("fulfillment")
	_, err := h.admin.Exec(ctx, `
		INSERT INTO `+s+`.outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
		                          schema_version, subject, payload, occurred_at, published_at)
		SELECT gen_random_uuid(), 'chaos', 'retention-filler', g, 'ChaosRetentionFiller', 1,
		       'fulfillment.chaos.filler', '{}', now() - interval '100 hours' + g * interval '1 ms',
		       now() - interval '100 hours' + g * interval '1 ms'
		FROM generate_series(1, $1::int) g`, fillerEvents)
	if err == nil {
		_, err = h.admin.Exec(ctx, `INSERT INTO `+s+`.outbox_sequences VALUES ('chaos', 'retention-filler', $1)`, fillerEvents)
	}
	if err != nil {
		h.t.Fatalf("retention filler: %v", err)
	}
}
