package order

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/natstest"
	"github.com/shop-ref/shop/internal/registry"
)

// While the saga's consumers have more than MaxBacklog events to settle,
// POST /orders is 503 with Retry-After and writes nothing; once they catch
// up, the same key creates the order.
func TestOrdersAreShedWhileTheSagaLags(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{MaxBacklog: 3})
	e.stock(t, "SKU-1", 100)
	ctx := context.Background()

	// A consumer of the saga on ORDERS that has not settled five events
	// (this test runs no inventory service: it plays that consumer).
	slow, err := e.js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
		Durable: "inventory-orders", AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		natstest.Publish(t, e.js, nats.NewMsg("orders.x.Something"))
	}

	const body = `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`
	var res response
	var key string
	tries := 0
	eventually(t, "POST /orders to be shed", func() bool { // the backlog is read every 200ms
		tries++
		key = fmt.Sprint("shed-", tries)
		res = e.post(t, key, body)
		return res.status == http.StatusServiceUnavailable
	})
	if res.header.Get("Retry-After") != "1" || !strings.Contains(string(res.body), `"code":"overloaded"`) {
		t.Errorf("shed answer: Retry-After %q, body %s", res.header.Get("Retry-After"), res.body)
	}
	if n := e.count(t, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, key); n != 0 {
		t.Errorf("a shed request stored its key")
	}

	// The consumer catches up.
	batch, err := slow.Fetch(5)
	if err != nil {
		t.Fatal(err)
	}
	for m := range batch.Messages() {
		if err := m.DoubleAck(ctx); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "POST /orders to be admitted again", func() bool {
		res = e.post(t, key, body)
		return res.status == http.StatusCreated
	})
}

// A consumer outside the saga (a forker's loyalty service on ORDERS) that
// lags does not throttle orders: only the saga's consumers count.
func TestSideConsumerDoesNotThrottleOrders(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{MaxBacklog: 3})
	e.stock(t, "SKU-1", 100)
	ctx := context.Background()
	if _, err := e.js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
		Durable: "loyalty-orders", AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		natstest.Publish(t, e.js, nats.NewMsg("orders.x.Something"))
	}
	loyalty := registry.Reader{Service: "loyalty", Consumer: registry.Consumer{Name: "loyalty-orders", Stream: "ORDERS"}}
	a := &admission{js: e.js, limit: 3, every: time.Second, log: slog.New(slog.DiscardHandler),
		consumers: sagaConsumers(append(shopReaders(), loyalty))}
	n, err := a.read(ctx)
	if err != nil || n != 0 {
		t.Fatalf("backlog read %d, %v; want 0: the side consumer's 20 must not count", n, err)
	}
	const body = `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`
	for i := range 5 {
		if res := e.post(t, fmt.Sprint("side-", i), body); res.status != http.StatusCreated {
			t.Fatalf("order %d: %d %s, want 201", i, res.status, res.body)
		}
	}
}

// A broker that cannot be asked changes nothing: the outbox absorbs an
// outage, so it is no reason to start refusing orders, nor to stop.
func TestAdmissionKeepsItsLastReadingWhileTheBrokerIsAway(t *testing.T) {
	t.Parallel()
	srv := natstest.New(t)
	nc, js := srv.Connect(t)
	nc.Close()
	for _, last := range []int64{0, 10} {
		a := &admission{js: js, limit: 3, every: 10 * time.Millisecond, log: slog.New(slog.DiscardHandler),
			consumers: sagaConsumers(shopReaders())}
		a.backlog.Store(last)
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		a.run(ctx) // several failed readings
		cancel()
		if _, shed := a.shed(); shed != (last > a.limit) {
			t.Errorf("last reading %d: shed %v after failed readings, want %v", last, shed, last > a.limit)
		}
	}
}
