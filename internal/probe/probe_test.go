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

	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/natstest"
	"github.com/shop-ref/shop/internal/pgtest"
	"github.com/shop-ref/shop/internal/poll"
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
		if code := get(t, NewRouter(db.Pool, nc, nil), "/healthz", &body); code != http.StatusOK || body["status"] != "ok" {
			t.Errorf("GET /healthz = %d %v, want 200 {status: ok}", code, body)
		}
	})

	t.Run("readyz is ready with database and nats up", func(t *testing.T) {
		t.Parallel()
		var body readiness
		code := get(t, NewRouter(db.Pool, nc, nil), "/readyz", &body)
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
		code := get(t, NewRouter(pool, nc, nil), "/readyz", &body)
		dep := body.Dependencies["database"]
		if code != http.StatusServiceUnavailable || body.Status != "unavailable" || dep.Status != "down" || dep.Error == "" {
			t.Errorf("GET /readyz = %d %+v, want 503 with the database down and why", code, body)
		}
		rec := httptest.NewRecorder()
		NewRouter(pool, nc, nil).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		if got := rec.Header().Get("Retry-After"); rec.Code != http.StatusServiceUnavailable || got != "1" {
			t.Errorf("GET /readyz = %d with Retry-After %q, want 503 with Retry-After: 1", rec.Code, got)
		}
	})

	t.Run("HEAD is served wherever GET is", func(t *testing.T) {
		t.Parallel()
		h := NewRouter(db.Pool, nc, nil)
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
	h := NewRouter(db.Pool, nc, nil)

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
	h := NewRouter(db.Pool, nc, watch)
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
