package dashboard_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/ops/dashboard"
	"github.com/shop-ref/shop/proof/poll"
)

// TestSeries runs the sampler over freshly migrated schemas: an order that
// completes after the dashboard started shows in the completion rate and
// the latency; one completed before does not; a pending outbox row is
// backlog; an event published by order and not processed by its consumer
// is lag; and the health strip says which service is ready.
func TestSeries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pools, exec := schemas(t)
	complete := func(created time.Time) {
		t.Helper()
		id := uuid.NewString()
		exec("order", `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at)
			VALUES ($1, 'c-1', 'COMPLETED', 1999, $2, now())`, id, created)
		exec("order", `INSERT INTO order_history (order_id, status, at) VALUES ($1, 'COMPLETED', $2)`, id, created.Add(1500*time.Millisecond))
	}
	complete(time.Now().Add(-time.Hour)) // before the dashboard: no rate
	ev := uuid.Must(uuid.NewV7())
	exec("order", `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
		schema_version, subject, payload, published_at) VALUES ($1, 'order', 'o-1', 1, 'OrderCreated', 1, 'orders.o-1.OrderCreated', '{}', now())`, ev)
	exec("inventory", `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
		schema_version, subject, payload) VALUES ($1, 'x', 'x-1', 1, 'InventoryReserved', 1, 'inventory.x-1.InventoryReserved', '{}')`, uuid.Must(uuid.NewV7()))

	ready := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"ok","dependencies":{"database":{"status":"up"},"nats":{"status":"up"},` +
			`"relay":{"status":"streaming","mode":"cdc","slot":{"name":"outbox_shop_orders","active":true,"wal_status":"reserved",` +
			`"lag_bytes":2048,"lag_age_seconds":1.5,"safe_wal_size_bytes":-1}}}}`))
	}))
	t.Cleanup(ready.Close)
	notReady := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(`{"status":"unavailable","dependencies":{"database":{"status":"down","error":"no route"}}}`))
	}))
	t.Cleanup(notReady.Close)

	d, err := dashboard.New(dashboard.Config{Pools: pools, OrderURL: ready.URL, PaymentURL: notReady.URL,
		Consumers: []dashboard.Consumer{
			{Name: "inventory-orders", Service: "inventory", Source: "order"},
			{Name: "fulfillment-orders", Service: "fulfillment", Source: "order", Types: []string{"OrderPaid"}},
		},
		SampleInterval: 100 * time.Millisecond, HealthInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-done })
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)

	var sr dashboard.Series
	read := func() dashboard.Series {
		t.Helper()
		res, err := http.Get(srv.URL + "/api/series")
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		var s dashboard.Series
		if err := json.NewDecoder(res.Body).Decode(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	last := func(col []*float64) float64 {
		if len(col) == 0 || col[len(col)-1] == nil {
			return -1
		}
		return *col[len(col)-1]
	}
	// A sample whose reads did not finish in time (a loaded machine) has
	// gaps, drawn as such: wait for one with the backlog and the lag in it.
	poll.Until(t, 10*time.Second, "a first sample with the backlog and the lag", func() bool {
		sr = read()
		return len(sr.T) > 0 && last(sr.Backlog["inventory"]) != -1 && last(sr.Lag["inventory"]) != -1 && last(sr.Lag["fulfillment"]) != -1
	})
	if got := last(sr.Completed); got != 0 {
		t.Errorf("completed/s before any order completed under the dashboard = %v, want 0", got)
	}
	if got := last(sr.Backlog["inventory"]); got != 1 {
		t.Errorf("inventory backlog = %v, want 1", got)
	}
	if got, other := last(sr.Lag["inventory"]), last(sr.Lag["fulfillment"]); got != 1 || other != 0 {
		t.Errorf("lag: inventory %v (want 1: OrderCreated unprocessed), fulfillment %v (want 0: it is delivered OrderPaid only)", got, other)
	}
	exec("inventory", `INSERT INTO processed_events (consumer_name, event_id) VALUES ('inventory-orders', $1)`, ev)
	complete(time.Now().Add(-1500 * time.Millisecond))
	poll.Until(t, 10*time.Second, "the completion in the charts", func() bool {
		sr = read()
		for i, c := range sr.Completed {
			if c != nil && *c > 0 && sr.P50[i] != nil && last(sr.Lag["inventory"]) == 0 {
				return true
			}
		}
		return false
	})
	if p := last(sr.P99); p < 1400 || p > 1600 {
		t.Errorf("p99 = %v ms, want about 1500", p)
	}

	var st dashboard.State
	poll.Until(t, 10*time.Second, "the health strip", func() bool {
		st = getState(t, srv.URL)
		return len(st.Health) == 2
	})
	h := map[string]dashboard.Health{}
	for _, x := range st.Health {
		h[x.Service] = x
	}
	if !h["order"].OK || h["order"].Detail != "database up · nats up · relay streaming" {
		t.Errorf("order health: %+v", h["order"])
	}
	// The relay's mode and its slot's lag and wal_status, for the chip.
	if r := h["order"].Relay; r == nil || r.Mode != "cdc" || r.Status != "streaming" || r.Slot == nil ||
		r.Slot.Name != "outbox_shop_orders" || r.Slot.WALStatus != "reserved" || r.Slot.LagBytes != 2048 ||
		r.Slot.LagAgeSeconds != 1.5 || r.Slot.SafeWALBytes != -1 {
		t.Errorf("order's relay: %+v", h["order"].Relay)
	}
	if h["payment"].Relay != nil {
		t.Errorf("payment's relay: %+v, want none (its /readyz has no relay line)", h["payment"].Relay)
	}
	if h["payment"].OK || h["payment"].Detail != "database down (no route)" {
		t.Errorf("payment health: %+v", h["payment"])
	}
}
