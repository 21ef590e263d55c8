package probe

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

// get serves one GET on h and decodes the JSON body into v.
func get(t *testing.T, h http.Handler, path string, v any) int {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("GET %s: Content-Type %q, want application/json", path, ct)
	}
	if err := json.Unmarshal(rec.Body.Bytes(), v); err != nil {
		t.Fatalf("GET %s: body %q: %v", path, rec.Body, err)
	}
	return rec.Code
}

func TestHealth(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ns := natstest.New(t)
	nc, _ := ns.Connect(t)

	t.Run("healthz answers ok", func(t *testing.T) {
		t.Parallel()
		var body map[string]string
		if code := get(t, NewRouter(db.Pool, nc, nil, nil), "/healthz", &body); code != http.StatusOK || body["status"] != "ok" {
			t.Errorf("GET /healthz = %d %v, want 200 {status: ok}", code, body)
		}
	})

	t.Run("readyz is ready with database and nats up", func(t *testing.T) {
		t.Parallel()
		var body readiness
		code := get(t, NewRouter(db.Pool, nc, nil, nil), "/readyz", &body)
		if code != http.StatusOK || body.Status != "ok" ||
			body.Dependencies["database"].Status != "up" || body.Dependencies["nats"].Status != "up" {
			t.Errorf("GET /readyz = %d %+v, want 200 with both up", code, body)
		}
	})

	t.Run("readyz is unavailable when the database does not answer", func(t *testing.T) {
		t.Parallel()
		// Nothing listens on port 1; the pool connects lazily, so only the
		// ping finds out.
		pool, err := database.NewPool(context.Background(), "postgres://postgres:postgres@127.0.0.1:1/shop?connect_timeout=2", "orders", 1)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		var body readiness
		code := get(t, NewRouter(pool, nc, nil, nil), "/readyz", &body)
		dep := body.Dependencies["database"]
		if code != http.StatusServiceUnavailable || body.Status != "unavailable" || dep.Status != "down" || dep.Error == "" {
			t.Errorf("GET /readyz = %d %+v, want 503 with the database down and why", code, body)
		}
		rec := httptest.NewRecorder()
		NewRouter(pool, nc, nil, nil).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		if got := rec.Header().Get("Retry-After"); rec.Code != http.StatusServiceUnavailable || got != "1" {
			t.Errorf("GET /readyz = %d with Retry-After %q, want 503 with Retry-After: 1", rec.Code, got)
		}
	})

	t.Run("HEAD is served wherever GET is", func(t *testing.T) {
		t.Parallel()
		h := NewRouter(db.Pool, nc, nil, nil)
		for _, path := range []string{"/healthz", "/readyz"} {
			// A real server: it is net/http that leaves out the body.
			srv := httptest.NewServer(h)
			defer srv.Close()
			res, err := http.Head(srv.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			res.Body.Close()
			if res.StatusCode != http.StatusOK || res.Header.Get("Content-Type") != "application/json" {
				t.Errorf("HEAD %s = %d %q, want 200 application/json", path, res.StatusCode, res.Header.Get("Content-Type"))
			}
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/healthz", nil))
		if rec.Code != http.StatusMethodNotAllowed {
			t.Errorf("POST /healthz = %d, want 405", rec.Code)
		}
	})
}

// A broker outage is absorbed by the outbox, so it must not take the service
// out of a load balancer.
func TestReadyWithoutNATS(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ns := natstest.New(t)
	nc, _ := ns.Connect(t)
	h := NewRouter(db.Pool, nc, nil, nil)

	ns.Stop()
	poll.Until(t, 10*time.Second, "the client to notice the server stopped", func() bool { return nc.Status() != nats.CONNECTED })

	var body readiness
	code := get(t, h, "/readyz", &body)
	if code != http.StatusOK || body.Dependencies["nats"].Status != "down" || body.Dependencies["database"].Status != "up" {
		t.Errorf("GET /readyz with NATS stopped = %d %+v, want 200 reporting nats down", code, body)
	}

	ns.Start()
	poll.Until(t, 10*time.Second, "the client to reconnect to the server back", func() bool { return nc.Status() == nats.CONNECTED })
	if code := get(t, h, "/readyz", &body); code != http.StatusOK || body.Dependencies["nats"].Status != "up" {
		t.Errorf("GET /readyz after NATS came back = %d %+v, want 200 reporting nats up", code, body)
	}
}

// JetStream switched off while core NATS stays up: the connection line says
// up, the jetstream line says down and since when; the database still
// decides readiness. Then it comes back (with a restart of the server).
func TestReadyReportsJetStreamItself(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ns := natstest.New(t)
	nc, _ := ns.Connect(t)
	watch, err := NewJetStream(nc, "inventory", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	h := NewRouter(db.Pool, nc, watch, nil)
	ctx := context.Background()

	var body readiness
	watch.probe(ctx)
	if code := get(t, h, "/readyz", &body); code != http.StatusOK || body.Dependencies["jetstream"].Status != "up" {
		t.Fatalf("GET /readyz = %d %+v, want jetstream up", code, body)
	}
	ns.DisableJetStream()
	watch.probe(ctx)
	code := get(t, h, "/readyz", &body)
	js := body.Dependencies["jetstream"]
	if code != http.StatusOK || body.Dependencies["nats"].Status != "up" || js.Status != "down" ||
		js.Since == nil || !strings.HasPrefix(js.Error, "unavailable since ") {
		t.Fatalf("GET /readyz with JetStream off = %d %+v, want 200, nats up, jetstream down since a time", code, body)
	}
	ns.Restart() // JetStream comes back with the server
	poll.Until(t, time.Minute, "readyz to report jetstream up again", func() bool {
		watch.probe(ctx)
		return get(t, h, "/readyz", &body) == http.StatusOK && body.Dependencies["jetstream"].Status == "up"
	})
}

// The relay's line: in cdc mode, a database that cannot serve CDC keeps the
// service ready (the relay polls) and the line says why, naming the
// variable to set; a slot the relay does not use (poll mode) is shown with
// what it pins; a slot whose WAL the server no longer keeps is named.
func TestReadyReportsTheRelay(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ns := natstest.New(t)
	nc, _ := ns.Connect(t)
	ctx := context.Background()
	var database string
	if err := db.Pool.QueryRow(ctx, `SELECT current_database()`).Scan(&database); err != nil {
		t.Fatal(err)
	}
	slot := outbox.SlotName(database, db.Name)

	// The relay's state is its own to compute (pkg/outbox's tests); here
	// it is the input the report is made of.
	var state outbox.State
	h := NewRouter(db.Pool, nc, nil, &Relay{Var: "ORDER_RELAY_MODE", State: func() outbox.State { return state }, DB: db.Pool,
		DropSlot: "shop slots drop --service order"})
	var body readiness

	state = outbox.State{Mode: outbox.ModeCDC, Slot: slot,
		CDCUnavailable: `wal_level is "replica": set wal_level=logical in postgresql.conf and restart the server`}
	code := get(t, h, "/readyz", &body)
	relay := body.Dependencies["relay"]
	if code != http.StatusOK || relay.Status != "polling" || relay.Mode != "cdc" ||
		!strings.Contains(relay.Error, "wal_level=logical") || !strings.Contains(relay.Error, "ORDER_RELAY_MODE=poll") {
		t.Errorf("GET /readyz, CDC unavailable = %d %+v, want 200, relay polling, naming wal_level and ORDER_RELAY_MODE", code, body)
	}
	if relay.Slot == nil || relay.Slot.Name != slot || relay.Slot.WALStatus != "" {
		t.Errorf("relay's slot = %+v, want %s, not made (no wal_status)", relay.Slot, slot)
	}

	// A slot of this schema's outbox, while the relay polls: shown, and
	// said to pin WAL.
	// Its publication first, as a relay makes them: a slot without one
	// (even while it is being made) is an orphan that other tests'
	// clean-up drops, terminating the backend that makes it.
	if _, err := db.Pool.Exec(ctx, "CREATE PUBLICATION "+pgx.Identifier{slot}.Sanitize()+" FOR TABLE "+
		pgx.Identifier{db.Name, "outbox"}.Sanitize()+" WITH (publish = 'insert')"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := outbox.DropSlot(context.Background(), db.Pool, slot); err != nil {
			t.Error(err)
		}
	})
	state = outbox.State{Mode: outbox.ModePoll}
	code = get(t, h, "/readyz", &body)
	relay = body.Dependencies["relay"]
	if code != http.StatusOK || relay.Status != "polling" || relay.Slot == nil || relay.Slot.Name != slot ||
		relay.Slot.WALStatus != "reserved" || relay.Slot.SafeWALBytes == 0 || !strings.Contains(relay.Error, "ORDER_RELAY_MODE=cdc") ||
		!strings.Contains(relay.Error, "shop slots drop --service order") {
		t.Errorf("GET /readyz, poll mode, slot made = %d %+v, want 200, the slot reserved, said to pin WAL, with the command that drops it", code, body)
	}

	// wal_status lost and unreserved need a server that went past
	// max_slot_wal_keep_size: their wording is checked on the stats.
	for _, status := range []string{"lost", "unreserved"} {
		got := slotProblems(outbox.SlotStats{Slot: slot, Exists: true, WALStatus: status}, outbox.ModeCDC, "ORDER_RELAY_MODE", "")
		if len(got) != 1 || !strings.Contains(got[0], "wal_status "+status) || !strings.Contains(got[0], slot) {
			t.Errorf("slot %s: problems %q, want one naming the slot and wal_status %s", status, got, status)
		}
	}
	if got := slotProblems(outbox.SlotStats{Slot: slot, Exists: true, WALStatus: "reserved"}, outbox.ModeCDC, "X", ""); len(got) != 0 {
		t.Errorf("a reserved slot in cdc mode: problems %q, want none", got)
	}
}
