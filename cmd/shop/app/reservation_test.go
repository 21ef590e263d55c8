package app

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/saga/sagatest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

// part is one service of a test shop, which can be stopped and started
// again as its process would be: same schema, same durable consumers.
type part struct {
	t     *testing.T
	name  string
	cfg   config.Config
	nc    *nats.Conn
	js    jetstream.JetStream
	pool  *pgxpool.Pool // the service's
	admin *pgxpool.Pool // the test's, for reading its schema
	url   string        // the HTTP server of the current run
	stop  func()
}

func (p *part) start() {
	p.t.Helper()
	s, err := New(p.name, p.cfg, p.nc, slog.New(slog.DiscardHandler))
	if err != nil {
		p.t.Fatal(err)
	}
	relay, dom, h, err := s.assemble(p.pool, p.js)
	if err != nil {
		p.t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = relay.Run(ctx) })
	wg.Go(func() { _ = dom.Run(ctx) })
	p.url = srv.URL
	p.stop = func() { cancel(); wg.Wait(); srv.Close(); p.stop = func() {} }
}

func (p *part) count(q string, args ...any) int {
	p.t.Helper()
	var n int
	if err := p.admin.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		p.t.Fatalf("%s: %s: %v", p.name, q, err)
	}
	return n
}

// testShop runs every service, each on a schema of its own, on one NATS
// server, configured by env; every part is running when it returns.
func testShop(t *testing.T, env map[string]string) map[string]*part {
	t.Helper()
	ns := natstest.New(t)
	nc, js := ns.Connect(t)
	cfg, err := LoadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	parts := map[string]*part{}
	for _, e := range cfg.Registry {
		db := pgtest.New(t, e.Sets()...)
		parts[e.Name] = &part{t: t, name: e.Name, cfg: cfg, nc: nc, js: js, admin: db.Pool, pool: db.NewPool(t, e.PoolSize)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ensureEveryStream(ctx, js, slog.New(slog.DiscardHandler)); err != nil || ctx.Err() != nil {
		t.Fatalf("ensure streams: %v %v", err, ctx.Err())
	}
	for _, name := range cfg.Registry.Names() {
		parts[name].start()
	}
	// After the pools, so the parts stop before their pools close.
	t.Cleanup(func() {
		for _, p := range parts {
			p.stop()
		}
	})
	return parts
}

// An order that inventory does not answer (its process is down) is closed
// after ORDER_RESERVATION_TIMEOUT; when inventory comes back it reserves
// the order's stock, late, and releases it again on the OrderClosed that
// follows, so every invariant of shop verify holds, ended orders holding no
// stock among them.
func TestReservationTimeoutReleasesALateReservation(t *testing.T) {
	t.Parallel()
	shop := testShop(t, map[string]string{"ORDER_RESERVATION_TIMEOUT": "1s"})
	ord, inv := shop["order"], shop["inventory"]
	do(t, http.MethodPut, inv.url+"/stock/SKU-R", `{"on_hand":5,"price":300}`, http.StatusOK)
	poll.Until(t, time.Minute, "the order service to learn SKU-R", func() bool {
		return ord.count(`SELECT count(*) FROM catalogue WHERE sku = 'SKU-R'`) == 1
	})

	inv.stop()
	req, _ := http.NewRequest(http.MethodPost, ord.url+"/orders", bytes.NewReader([]byte(`{"customer_id":"c-1","items":[{"sku":"SKU-R","quantity":2}]}`)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "late-reservation")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var o struct {
		ID string `json:"order_id"`
	}
	err = json.NewDecoder(res.Body).Decode(&o)
	res.Body.Close()
	if err != nil || res.StatusCode != http.StatusCreated {
		t.Fatalf("POST /orders: %s, %v", res.Status, err)
	}
	poll.Until(t, time.Minute, "the order to be closed by its reservation timeout", func() bool {
		return ord.count(`SELECT count(*) FROM order_history WHERE order_id = $1 AND status = 'CLOSED' AND reason = 'reservation_timeout'`, o.ID) == 1
	})

	inv.start()
	poll.Until(t, time.Minute, "inventory to reserve late and release", func() bool {
		return inv.count(`SELECT count(*) FROM reservations WHERE order_id = $1 AND state = 'RELEASED'`, o.ID) == 1
	})
	poll.Until(t, time.Minute, "the late InventoryReserved to reach the closed order", func() bool {
		n := 0
		for _, u := range sagatest.UnexpectedEvents(t, ord.admin, o.ID) {
			if u.State == "CLOSED" && u.EventType == "InventoryReserved" {
				n++
			}
		}
		return n == 1
	})
	if n := inv.count(`SELECT reserved FROM stock WHERE sku = 'SKU-R'`); n != 0 {
		t.Fatalf("SKU-R has %d units reserved, want 0", n)
	}
	checked := verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{}}
	for name, p := range shop {
		checked.Pools[name] = p.admin
	}
	report, err := verify.Wait(context.Background(), checked, OutboxRetention, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !report.OK() {
		var b bytes.Buffer
		report.Write(&b)
		t.Fatalf("shop verify:\n%s", b.String())
	}
}
