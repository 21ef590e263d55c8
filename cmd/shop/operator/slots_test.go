package operator

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgcluster"
	"github.com/shop-ref/shop/proof/poll"
)

// TestSlots: the shop's replication slots, made by relays in cdc mode on
// a private cluster, are the shop's to list and drop (shop slots), and
// what happens without it: a wal_level lowered for the next restart while
// they exist, which shop verify names with the command to run, then
// Postgres refusing to start. Dropped, the server starts with
// wal_level=replica.
func TestSlots(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := pgcluster.Start(t, map[string]string{"max_connections": "100"})
	admin, err := pgx.Connect(ctx, pg.URL())
	if err != nil {
		t.Fatal(err)
	}
	sql := func(stmt string, args ...any) {
		t.Helper()
		if _, err := admin.Exec(ctx, stmt, args...); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	// wal_level from the configuration files, as a server an operator
	// runs has it (the cluster's command line would win over them).
	sql(`ALTER SYSTEM SET wal_level = logical`)
	admin.Close(ctx)
	pg.Configure(map[string]string{"wal_level": ""})
	if err := pg.Restart(ctx, pgcluster.Fast); err != nil {
		t.Fatal(err)
	}
	if admin, err = pgx.Connect(ctx, pg.URL()); err != nil {
		t.Fatal(err)
	}
	defer func() { admin.Close(context.Background()) }()

	dbURL := pg.URL()
	cli := shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL})}
	cli.ok("migrate")
	ns := natstest.New(t)
	_, js := ns.Connect(t)

	// The order and inventory services' relays, in cdc mode: each makes
	// its slot and streams it.
	relays := map[string]func(){}
	for _, s := range []struct{ name, schema string }{{"order", "orders"}, {"inventory", "inventory"}} {
		pool, err := database.NewPool(ctx, dbURL, s.schema, 4)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		relay, err := outbox.NewRelay(pool, js, outbox.Config{Name: s.name + "-relay", Mode: outbox.ModeCDC,
			PollInterval: 100 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- relay.Run(rctx) }()
		relays[s.name] = func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("%s relay: %v", s.name, err)
			}
		}
		t.Cleanup(func() {
			if stop := relays[s.name]; stop != nil {
				stop()
			}
		})
	}
	list := func() map[string]serviceSlot {
		t.Helper()
		var r slotsReport
		cli.json(&r, "slots", "list", "--json")
		m := map[string]serviceSlot{}
		for _, s := range r.Services {
			m[s.Service] = s
		}
		if len(r.Other) != 0 {
			t.Errorf("other slots %+v, want none", r.Other)
		}
		return m
	}
	streamed := func(service string) func() bool {
		return func() bool {
			s := list()[service]
			return s.Exists && s.Active && s.Streamer == service+"-relay" && s.Publication
		}
	}
	poll.Until(t, 30*time.Second, "the order relay streams its slot", streamed("order"))
	poll.Until(t, 30*time.Second, "the inventory relay streams its slot", streamed("inventory"))
	for name, s := range list() {
		if _, streaming := relays[name]; !streaming && (s.Exists || s.Publication) {
			t.Errorf("%s: %+v, want no slot, no publication", name, s)
		}
	}
	out := cli.ok("slots", "list")
	for _, want := range []string{"STREAMED BY", "order-relay (pid", "WAL HELD", "reserved"} {
		if !strings.Contains(out, want) {
			t.Errorf("shop slots list lacks %q:\n%s", want, out)
		}
	}

	// Streamed slots are refused, each naming its relay.
	out, _, err = cli.run("slots", "drop")
	if !errors.Is(err, errSlotsRefused) {
		t.Fatalf("shop slots drop with relays streaming: %v, want %v\n%s", err, errSlotsRefused, out)
	}
	for _, want := range []string{"order: slot", "NOT dropped: relay order-relay (pid", "ORDER_RELAY_MODE=poll", "inventory: slot", "payment: no slot"} {
		if !strings.Contains(out, want) {
			t.Errorf("shop slots drop lacks %q:\n%s", want, out)
		}
	}
	if s := list(); !s["order"].Exists || !s["inventory"].Exists {
		t.Fatalf("a refused drop dropped: %+v", s)
	}
	// -force ends the stream; the relay, still in cdc mode, makes the
	// slot again, as the usage says.
	if out := cli.ok("slots", "drop", "--service", "order", "-force"); !strings.Contains(out, "order: dropped slot") {
		t.Errorf("shop slots drop --service order -force:\n%s", out)
	}
	poll.Until(t, 30*time.Second, "the order relay streams its slot made again", streamed("order"))

	// The relays stop (the services switched to poll, say): the slots
	// stay, and no relay confirms them.
	for name, stop := range relays {
		stop()
		relays[name] = nil
	}
	poll.Until(t, 30*time.Second, "the slots left by the stopped relays", func() bool {
		s := list()
		return s["order"].Exists && !s["order"].Active && s["inventory"].Exists && !s["inventory"].Active
	})
	// What the relay's heartbeat last recorded ten minutes ago: verify
	// says nobody streams it, and how to drop it.
	slot := list()["order"].Slot
	sql(`INSERT INTO orders.outbox_slots (slot, caught_up_at) VALUES ($1, now() - interval '10 minutes')
		ON CONFLICT (slot) DO UPDATE SET caught_up_at = EXCLUDED.caught_up_at`, slot)
	out, _, err = cli.run("verify", "-streams=false")
	if !errors.Is(err, ErrViolations) || !strings.Contains(out, "no relay streams it: run the service with ORDER_RELAY_MODE=cdc") ||
		!strings.Contains(out, "shop slots drop --service order") {
		t.Errorf("shop verify with a slot nobody streams: %v, want a violation naming the relay mode and the drop command:\n%s", err, out)
	}
	// As a role that may not replicate, verify names the privilege.
	sql(`CREATE ROLE auditor LOGIN`)
	sql(`GRANT pg_read_all_data, pg_read_all_stats TO auditor`)
	asAuditor := shopCLI{t, env(map[string]string{"DATABASE_URL": strings.Replace(dbURL, "postgres@", "auditor@", 1)})}
	out, _, _ = asAuditor.run("verify", "-streams=false")
	if !strings.Contains(out, "no relay can stream it from this server: role auditor may not replicate: ALTER ROLE \"auditor\" REPLICATION") {
		t.Errorf("shop verify as a role without REPLICATION: want the privilege named:\n%s", out)
	}

	// wal_level lowered for the next restart, the slots still there:
	// verify says Postgres will not start, and what to run first.
	sql(`ALTER SYSTEM SET wal_level = replica`)
	sql(`SELECT pg_reload_conf()`)
	poll.Until(t, 30*time.Second, "shop verify to name the pending wal_level change", func() bool {
		out, _, _ := cli.run("verify", "-streams=false")
		return strings.Contains(out, "inventory: wal_level is changed for the next restart of Postgres (pending_restart), and slot") &&
			strings.Contains(out, "Postgres will not start with it; drop the slot first: shop slots drop --service inventory")
	})
	admin.Close(ctx)
	err = pg.Restart(ctx, pgcluster.Fast)
	if err == nil || !strings.Contains(err.Error(), "exists, but wal_level < logical") {
		t.Fatalf("Postgres restarted with wal_level=replica and the shop's slots: %v, want it refused", err)
	}
	t.Logf("as the issue saw it: %s", firstLine(err.Error(), "wal_level < logical"))

	// Back to logical for a moment (the command line wins), drop the
	// slots, and the server starts with wal_level=replica.
	pg.Configure(map[string]string{"wal_level": "logical"})
	if err := pg.Start(ctx); err != nil {
		t.Fatal(err)
	}
	out = cli.ok("slots", "drop")
	for _, want := range []string{"order: dropped slot", "inventory: dropped slot", "payment: no slot", "fulfillment: no slot"} {
		if !strings.Contains(out, want) {
			t.Errorf("shop slots drop lacks %q:\n%s", want, out)
		}
	}
	for name, s := range list() {
		if s.Exists || s.Publication {
			t.Errorf("%s after the drop: %+v, want no slot, no publication", name, s)
		}
	}
	pg.Configure(map[string]string{"wal_level": ""})
	if err := pg.Restart(ctx, pgcluster.Fast); err != nil {
		t.Fatalf("Postgres with wal_level=replica and no slots: %v", err)
	}
	conn, err := pgx.Connect(ctx, pg.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var level string
	if err := conn.QueryRow(ctx, `SHOW wal_level`).Scan(&level); err != nil || level != "replica" {
		t.Errorf("wal_level = %q (%v), want replica", level, err)
	}
}

// firstLine returns the first line of s that contains substr, or s.
func firstLine(s, substr string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			return strings.TrimSpace(l)
		}
	}
	return s
}
