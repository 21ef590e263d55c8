package journey_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/ops/journey"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// setup returns four freshly migrated service schemas' pools, and the same
// as journey.Load takes them.
func setup(t *testing.T) (map[string]*pgxpool.Pool, map[string]journey.DB) {
	t.Helper()
	pools, dbs := map[string]*pgxpool.Pool{}, map[string]journey.DB{}
	for name, p := range shoptest.Schemas(t, services.All).Pools {
		pools[name], dbs[name] = p, p
	}
	return pools, dbs
}

// TestLoad writes the rows an order leaves on its way, at known times, and
// reads them back as a timeline: the order in WAIT_PAY; its events in two
// outboxes (one published, one still retrying) and inventory's reply; the
// consumers' inbox rows; a failing consumer, a dead letter, a parked event,
// an event the saga ignored and the armed payment timeout. Another order's
// rows stay out of it.
func TestLoad(t *testing.T) {
	t.Parallel()
	pools, dbs := setup(t)
	ctx := context.Background()
	exec := func(service, sql string, args ...any) {
		t.Helper()
		if _, err := pools[service].Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", service, err)
		}
	}
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	order, other := uuid.New(), uuid.New()
	created, awaiting, reserved, stray := uuid.New(), uuid.New(), uuid.New(), uuid.New()

	for _, id := range []uuid.UUID{order, other} {
		exec("order", `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at)
			VALUES ($1, 'c-1', 'WAIT_PAY', 1999, $2, $2)`, id, t0)
		exec("order", `INSERT INTO order_history (order_id, status, at) VALUES ($1, 'PENDING', $2)`, id, at(0))
	}
	exec("order", `INSERT INTO order_history (order_id, status, at, reason) VALUES ($1, 'WAIT_PAY', $2, 'inventory_reserved')`, order, at(30))
	exec("order", `INSERT INTO saga_instances (id, type, state) VALUES ($1, 'order', 'WAIT_PAY')`, order.String())
	exec("order", `INSERT INTO saga_timeouts (saga_id, name, due_at) VALUES ($1, 'payment', $2)`, order.String(), at(15*60*1000))
	exec("order", `INSERT INTO saga_unexpected (saga_id, saga_type, state, event_type, event_id, recorded_at)
		VALUES ($1, 'order', 'WAIT_PAY', 'InventoryReserved', $2, $3)`, order.String(), uuid.NewString(), at(60))

	event := func(service string, id uuid.UUID, aggregate uuid.UUID, seq int, typ string, occurred time.Time, published *time.Time, attempts int) {
		t.Helper()
		exec(service, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version,
			subject, payload, occurred_at, published_at, attempts, last_error)
			VALUES ($1, 'order', $2, $3, $4, 1, $5, '{}', $6, $7, $8, CASE WHEN $8 > 0 THEN 'nats: timeout' END)`,
			id, aggregate.String(), seq, typ, service+"."+aggregate.String()+"."+typ, occurred, published, attempts)
	}
	p := func(ms int) *time.Time { v := at(ms); return &v }
	event("order", created, order, 1, "OrderCreated", at(0), p(5), 0)
	event("order", awaiting, order, 2, "OrderAwaitingPayment", at(30), nil, 2)
	event("inventory", reserved, order, 1, "InventoryReserved", at(12), p(20), 0)
	event("order", stray, other, 1, "OrderCreated", at(1), p(2), 0)

	processed := func(service, consumer string, id uuid.UUID, when time.Time) {
		t.Helper()
		exec(service, `INSERT INTO processed_events (consumer_name, event_id, processed_at) VALUES ($1, $2, $3)`, consumer, id, when)
	}
	processed("inventory", "inventory-orders", created, at(12))
	processed("payment", "payment-orders", created, at(4)) // before the relay recorded its publish
	processed("order", "order-inventory", reserved, at(30))
	processed("inventory", "inventory-orders", stray, at(3))
	exec("fulfillment", `INSERT INTO inbox_failures (consumer_name, event_id, attempts, first_failed_at, last_failed_at, last_error)
		VALUES ('fulfillment-orders', $1, 3, $2, $3, 'database is down')`, created, at(7), at(40))
	exec("payment", `INSERT INTO dead_letters (consumer_name, stream, stream_seq, subject, headers, payload, event_id,
		error, attempts, first_failed_at, last_failed_at) VALUES ('payment-orders', 'ORDERS', 7, $1, '{}', '', NULL,
		'undecodable', 1, $2, $2)`, "orders."+order.String()+".OrderPaid", at(50))
	exec("inventory", `INSERT INTO inbox_parked (consumer_name, source, aggregate_type, aggregate_id, aggregate_seq, event_id,
		stream, stream_seq, subject, headers, payload, parked_at) VALUES ('inventory-orders', 'orders', 'order', $1, 4,
		gen_random_uuid(), 'ORDERS', 9, $2, '{}', '', $3)`, order.String(), "orders."+order.String()+".OrderClosed", at(70))

	j, err := journey.Load(ctx, dbs, order)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("lists every step in time order", func(t *testing.T) {
		var got []string
		for _, e := range j.Entries {
			got = append(got, e.At.Sub(t0).String()+" "+e.Service+" "+e.What)
		}
		want := []string{
			"0s order state PENDING",
			"0s order OrderCreated committed (seq 1)",
			"4ms payment OrderCreated processed by payment-orders",
			"5ms order OrderCreated published by the relay",
			"12ms inventory OrderCreated processed by inventory-orders",
			"12ms inventory InventoryReserved committed (seq 1)",
			"20ms inventory InventoryReserved published by the relay",
			"30ms order InventoryReserved processed by order-inventory",
			"30ms order state PENDING → WAIT_PAY (inventory_reserved)",
			"30ms order OrderAwaitingPayment committed (seq 2), not published yet after 2 failed attempts (last: nats: timeout), next try at ",
			"40ms fulfillment OrderCreated failing in fulfillment-orders: 3 attempts since 12:00:00.007, retried with backoff (last error: database is down)",
			"50ms payment OrderPaid dead-lettered by payment-orders after 1 attempt: undecodable; open (shop outbox dead-letters requeue|discard)",
			"60ms order saga ignored InventoryReserved in state WAIT_PAY (no transition)",
			"70ms inventory OrderClosed (seq 4) parked by inventory-orders: an earlier event of the order has not arrived",
		}
		if len(got) != len(want) {
			t.Fatalf("%d entries, want %d:\n%s", len(got), len(want), strings.Join(got, "\n"))
		}
		for i := range want {
			if !strings.HasPrefix(got[i], want[i]) {
				t.Errorf("entry %d:\n got %s\nwant %s", i, got[i], want[i])
			}
		}
	})

	t.Run("measures each hop from the step it follows", func(t *testing.T) {
		hop := map[string]string{}
		for _, e := range j.Entries {
			if e.HopFrom != "" {
				hop[e.What] = e.Hop.String() + " from " + string(e.HopFrom)
			}
		}
		for what, want := range map[string]string{
			"OrderCreated published by the relay":            "5ms from committed",
			"OrderCreated processed by inventory-orders":     "7ms from published",
			"OrderCreated processed by payment-orders":       "4ms from committed", // committed before the publish was recorded
			"InventoryReserved published by the relay":       "8ms from committed",
			"InventoryReserved processed by order-inventory": "10ms from published",
		} {
			if hop[what] != want {
				t.Errorf("%s: hop %q, want %q", what, hop[what], want)
			}
		}
		if e := j.Entries[len(j.Entries)-1]; e.SincePrevious != 10*time.Millisecond {
			t.Errorf("last entry %q: %v since the previous, want 10ms", e.What, e.SincePrevious)
		}
	})

	t.Run("keeps the status, timeouts and JSON shape", func(t *testing.T) {
		if j.Status != "WAIT_PAY" || len(j.Timeouts) != 1 || j.Timeouts[0].Name != "payment" || !j.Timeouts[0].DueAt.Equal(at(15*60*1000)) {
			t.Errorf("status %q, timeouts %+v", j.Status, j.Timeouts)
		}
		if len(j.Notes) != 0 {
			t.Errorf("notes: %q", j.Notes)
		}
		b, err := json.Marshal(j)
		if err != nil {
			t.Fatal(err)
		}
		var raw struct {
			Entries []map[string]any `json:"entries"`
		}
		if err := json.Unmarshal(b, &raw); err != nil {
			t.Fatal(err)
		}
		published := raw.Entries[3]
		for key, want := range map[string]any{"kind": "published", "service": "order", "event_type": "OrderCreated",
			"event_id": created.String(), "seq": 1.0, "hop_seconds": 0.005, "hop_from": "committed", "since_previous_seconds": 0.001} {
			if published[key] != want {
				t.Errorf("%s = %v, want %v (%v)", key, published[key], want, published)
			}
		}
		if _, ok := raw.Entries[0]["hop_seconds"]; ok {
			t.Errorf("a state change has a hop: %v", raw.Entries[0])
		}
	})
}

func TestLoadNotFound(t *testing.T) {
	t.Parallel()
	_, dbs := setup(t)
	_, err := journey.Load(context.Background(), dbs, uuid.New())
	if !errors.Is(err, journey.ErrNotFound) {
		t.Fatalf("got %v, want ErrNotFound", err)
	}
}

// Once retention has deleted an order's published events, its journey still
// shows the state changes, and says why the events are missing.
func TestLoadAfterRetention(t *testing.T) {
	t.Parallel()
	pools, dbs := setup(t)
	ctx := context.Background()
	id := uuid.New()
	if _, err := pools["order"].Exec(ctx, `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at)
		VALUES ($1, 'c-1', 'PENDING', 1, now(), now())`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := pools["order"].Exec(ctx, `INSERT INTO order_history (order_id, status, at) VALUES ($1, 'PENDING', now())`, id); err != nil {
		t.Fatal(err)
	}
	j, err := journey.Load(ctx, dbs, id)
	if err != nil {
		t.Fatal(err)
	}
	if len(j.Entries) != 1 || j.Entries[0].Kind != journey.State || len(j.Notes) != 1 || !strings.Contains(j.Notes[0], "retention") {
		t.Errorf("entries %+v, notes %q", j.Entries, j.Notes)
	}
}
