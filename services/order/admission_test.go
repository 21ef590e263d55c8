package order

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
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
	poll.Until(t, 15*time.Second, "POST /orders to be shed", func() bool { // the backlog is read every 200ms
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
	poll.Until(t, 15*time.Second, "POST /orders to be admitted again", func() bool {
		res = e.post(t, key, body)
		return res.status == http.StatusCreated
	})
}

// A consumer outside the saga (a forker's analytics service on ORDERS) that
// lags does not throttle orders: only the saga's consumers count.
func TestSideConsumerDoesNotThrottleOrders(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{MaxBacklog: 3})
	e.stock(t, "SKU-1", 100)
	ctx := context.Background()
	if _, err := e.js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
		Durable: "analytics-orders", AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		natstest.Publish(t, e.js, nats.NewMsg("orders.x.Something"))
	}
	analytics := registry.Reader{Service: "analytics", Consumer: registry.Consumer{Name: "analytics-orders", Stream: "ORDERS"}}
	a := &admission{js: e.js, limit: 3, every: time.Second, log: slog.New(slog.DiscardHandler),
		consumers: sagaConsumers(append(shopReaders(), analytics))}
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

// The probe of issue 24: a peer with a producer's credentials publishes
// hundreds of events whose Aggregate-Seq the tables cannot take (2⁶³−1) or
// that come far ahead of their aggregate (2³¹). Each is dead-lettered or
// parked at once instead of being retried for ever, so the saga's backlog
// empties again and POST /orders is admitted, with the key it was shed
// with.
func TestOutOfRangeSequencesDoNotStopOrders(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{MaxBacklog: 100})
	e.stock(t, "SKU-1", 100)
	const hostile = 520
	for i := range hostile {
		m := e.upstream("inventory", "order", uuid.NewString(), "InventoryReserved", map[string]any{})
		m.Header.Set("Aggregate-Seq", []string{"9223372036854775807", "2147483648"}[i%2])
		e.send(t, m)
	}
	// What an operator sees (shop outbox dead-letters, parked): every one
	// of them set aside, none left retrying.
	ctx := context.Background()
	var dead []inbox.DeadLetter
	var parked []inbox.Parked
	poll.Until(t, 15*time.Second, "every hostile event to be dead-lettered or parked", func() bool {
		var err error
		if dead, err = inbox.ListDeadLetters(ctx, e.pool, "", 1000); err != nil {
			t.Fatal(err)
		}
		if parked, err = inbox.ListParked(ctx, e.pool, "", 1000); err != nil {
			t.Fatal(err)
		}
		return len(dead)+len(parked) >= hostile
	})
	const body = `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`
	poll.Until(t, 15*time.Second, "POST /orders to be admitted", func() bool {
		return e.post(t, "after-the-probe", body).status == http.StatusCreated
	})
	if len(dead) != hostile/2 || len(parked) != hostile/2 {
		t.Errorf("%d dead letters and %d parked, want %d of each", len(dead), len(parked), hostile/2)
	}
	for _, dl := range dead {
		if dl.Attempts != 1 || !strings.Contains(dl.Error, "Aggregate-Seq") {
			t.Fatalf("dead letter %+v: want one attempt, the header named", dl)
		}
	}
}
