//go:build shopbench

package benchsuite

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/services/inventory"
)

// ---- row 7c ----

// inventoryDrain is row 7 with a real handler: the inventory service's
// consumer, as the shop runs it, drains sz.consumed/4 OrderCreated events
// already in ORDERS, each order taking two of the 16 SKUs row 6 uses, so
// every reservation locks stock rows that many others lock too. It
// returns events/s per run.
func inventoryDrain(b *testing.B, sz sizes) []float64 {
	return scoped(b, func(tb testing.TB) []float64 {
		e := newEnv(tb, inventory.Registration.Sets())
		e.nats.Stream(tb, e.js, "ORDERS", "orders.>")
		e.nats.Stream(tb, e.js, "INVENTORY", "inventory.>")
		ctx := context.Background()
		skus := strings.Split(skuList, ",")
		if _, err := e.db.Pool.Exec(ctx, `
			INSERT INTO stock (sku, on_hand, reserved, sold, price, supplied)
			SELECT s, 1000000000, 0, 0, 100, 1000000000 FROM unnest($1::text[]) AS s`, skus); err != nil {
			tb.Fatal(err)
		}
		svc, err := inventory.New(registry.Deps{Pool: e.db.NewPool(tb, 12), JetStream: e.js, Logger: quietLogger()}, inventory.Config{})
		if err != nil {
			tb.Fatal(err)
		}
		c := svc.Consumers()[0]
		n := sz.consumed / 4
		var rates []float64
		for run := range *runs {
			publishOrders(tb, e, n, skus, run)
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			start := time.Now()
			go func() { _ = svc.Run(rctx); close(done) }()
			want := int64((run + 1) * n)
			deadline := time.Now().Add(5 * time.Minute)
			for c.Counters().Processed < want {
				if time.Now().After(deadline) {
					cancel()
					tb.Fatalf("inventory consumer: %d of %d after 5 minutes", c.Counters().Processed, want)
				}
				time.Sleep(2 * time.Millisecond)
			}
			rates = append(rates, float64(n)/time.Since(start).Seconds())
			cancel()
			<-done
		}
		if dead := c.Counters().DeadLetters; dead != 0 {
			tb.Fatalf("inventory consumer: %d dead letters", dead)
		}
		return rates
	})
}

// publishOrders puts n OrderCreated events in ORDERS as the order
// service's relay would send them, each a new order of two SKUs.
func publishOrders(tb testing.TB, e *env, n int, skus []string, run int) {
	tb.Helper()
	occurred := time.Now().UTC().Format(time.RFC3339Nano)
	natstest.PublishAll(tb, e.js, n, func(i int) (*nats.Msg, string) {
		id := uuid.Must(uuid.NewV7())
		k := run*n + i
		lines := []map[string]any{
			{"sku": skus[k%len(skus)], "quantity": 1, "unit_price": 100},
			{"sku": skus[(k*7+3)%len(skus)], "quantity": 1, "unit_price": 100},
		}
		if lines[0]["sku"] == lines[1]["sku"] {
			lines = lines[:1]
		}
		data, err := json.Marshal(map[string]any{"order_id": id.String(), "customer_id": "c-1", "items": lines,
			"total": 100 * len(lines), "currency": "EUR", "created_at": occurred})
		if err != nil {
			tb.Fatal(err)
		}
		h := nats.Header{}
		h.Set("Event-Type", inventory.TypeOrderCreated)
		h.Set("Aggregate-Type", "order")
		h.Set("Aggregate-Id", id.String())
		h.Set("Aggregate-Seq", "1")
		h.Set("Schema-Version", "1")
		h.Set("Occurred-At", occurred)
		return &nats.Msg{Subject: "orders." + id.String() + "." + inventory.TypeOrderCreated, Header: h, Data: data}, uuid.NewString()
	})
}
