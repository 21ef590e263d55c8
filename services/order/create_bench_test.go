package order

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
)

// BenchmarkCreateOrder drives POST /orders through the real handler, with
// the HTTP middlewares every service has that live outside cmd/shop/app
// (httpx.Bodies, httpx.Trace with no provider), against a migrated schema
// and an embedded NATS server, one request at a time. Besides time and
// allocations per request it reports database round trips per request,
// counted on the pool's connections, which do not depend on the machine's
// speed. The relay and the consumers do not run: this is the HTTP path
// alone. Profile with
//
//	go test -run '^$' -bench BenchmarkCreateOrder -benchmem -cpuprofile cpu.out ./services/order/
func BenchmarkCreateOrder(b *testing.B) {
	db := pgtest.New(b, Registration.Sets()...)
	srv := natstest.New(b)
	_, js := srv.Connect(b)
	for name, subj := range map[string]string{"ORDERS": "orders.>", "INVENTORY": "inventory.>", "PAYMENT": "payment.>", "FULFILLMENT": "fulfillment.>"} {
		srv.Stream(b, js, name, subj)
	}
	var trips roundTrips
	pool := countingPool(b, db, &trips)
	// Info, as `shop all` logs, into nothing: the cost of building each
	// record counts, the terminal's does not.
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	svc, err := New(registry.Deps{Pool: pool, JetStream: js, Logger: log, Readers: shopReaders()}, Config{})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO catalogue (sku, price, seq) VALUES ('SKU-1', 250, 1), ('SKU-2', 1999, 1)`); err != nil {
		b.Fatal(err)
	}
	r := chi.NewRouter()
	r.Use(httpx.Trace(nil))
	svc.Routes(r)
	h := httpx.Bodies(r)
	const body = `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2},{"sku":"SKU-2","quantity":1}]}`
	post := func(key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	// Warm up: every connection the loop will use has its statements
	// prepared, so the count below is of the steady state.
	for i := range 10 {
		if rec := post(fmt.Sprint("warm-", i)); rec.Code != http.StatusCreated {
			b.Fatalf("warm-up: %d %s", rec.Code, rec.Body)
		}
	}
	b.ReportAllocs()
	trips.n.Store(0)
	b.ResetTimer()
	for i := range b.N {
		if rec := post(fmt.Sprint("k-", i)); rec.Code != http.StatusCreated {
			b.Fatalf("%d %s", rec.Code, rec.Body)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(trips.n.Load())/float64(b.N), "roundtrips/op")
}

// roundTrips counts the database round trips of a pool: each time a
// connection reads after it has written, one request went out and its
// answer came back.
type roundTrips struct{ n atomic.Int64 }

// countingPool is a pool on db's schema whose connections count their
// round trips in trips.
func countingPool(tb testing.TB, db *pgtest.Schema, trips *roundTrips) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	if err != nil {
		tb.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = db.Name
	cfg.MaxConns = PoolSize
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: c, trips: trips}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

type countingConn struct {
	net.Conn
	trips *roundTrips
	wrote atomic.Bool
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.wrote.Store(true)
	return c.Conn.Write(p)
}

func (c *countingConn) Read(p []byte) (int, error) {
	if c.wrote.Swap(false) {
		c.trips.n.Add(1)
	}
	return c.Conn.Read(p)
}
