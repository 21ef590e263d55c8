package app

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/natstest"
	"github.com/shop-ref/shop/internal/pgtest"
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
	db := pgtest.New(t, "")
	ns := natstest.New(t)
	nc, _ := ns.Connect(t)

	t.Run("healthz answers ok", func(t *testing.T) {
		t.Parallel()
		var body map[string]string
		if code := get(t, newRouter(db.Pool, nc), "/healthz", &body); code != http.StatusOK || body["status"] != "ok" {
			t.Errorf("GET /healthz = %d %v, want 200 {status: ok}", code, body)
		}
	})

	t.Run("readyz is ready with database and nats up", func(t *testing.T) {
		t.Parallel()
		var body readiness
		code := get(t, newRouter(db.Pool, nc), "/readyz", &body)
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
		code := get(t, newRouter(pool, nc), "/readyz", &body)
		dep := body.Dependencies["database"]
		if code != http.StatusServiceUnavailable || body.Status != "unavailable" || dep.Status != "down" || dep.Error == "" {
			t.Errorf("GET /readyz = %d %+v, want 503 with the database down and why", code, body)
		}
	})
}

// A broker outage is absorbed by the outbox, so it must not take the service
// out of a load balancer.
func TestReadyWithoutNATS(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, "")
	ns := natstest.New(t)
	nc, _ := ns.Connect(t)
	h := newRouter(db.Pool, nc)

	ns.Stop()
	deadline := time.Now().Add(10 * time.Second)
	for nc.Status() == nats.CONNECTED {
		if time.Now().After(deadline) {
			t.Fatal("client still connected 10s after the server stopped")
		}
		time.Sleep(20 * time.Millisecond)
	}

	var body readiness
	code := get(t, h, "/readyz", &body)
	if code != http.StatusOK || body.Dependencies["nats"].Status != "down" || body.Dependencies["database"].Status != "up" {
		t.Errorf("GET /readyz with NATS stopped = %d %+v, want 200 reporting nats down", code, body)
	}

	ns.Start()
	deadline = time.Now().Add(10 * time.Second)
	for nc.Status() != nats.CONNECTED {
		if time.Now().After(deadline) {
			t.Fatal("client not reconnected 10s after the server came back")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if code := get(t, h, "/readyz", &body); code != http.StatusOK || body.Dependencies["nats"].Status != "up" {
		t.Errorf("GET /readyz after NATS came back = %d %+v, want 200 reporting nats up", code, body)
	}
}
