package fulfillment

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/inboxtest"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

const testDelay = 100 * time.Millisecond

type env struct {
	db *pgtest.Schema
	js jetstream.JetStream
}

// setup gives a test its own fulfillment schema and NATS server with the
// ORDERS stream it consumes and the FULFILLMENT stream it publishes to.
func setup(t *testing.T) *env {
	t.Helper()
	db := pgtest.New(t, Registration.Sets()...)
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	srv.Stream(t, js, "ORDERS", "orders.>")
	srv.Stream(t, js, "FULFILLMENT", "fulfillment.>")
	return &env{db: db, js: js}
}

// service returns a new Service ("another process") on its own pool, as
// large as the service's own (Registration.PoolSize).
func (e *env) service(t *testing.T) *Service {
	t.Helper()
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	s, err := New(registry.Deps{Pool: e.db.NewPool(t, Registration.PoolSize), JetStream: e.js, Logger: log}, Config{Delay: testDelay})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// run runs s until the test ends and checks that Run then returns nil.
func run(t *testing.T, s *Service) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after its context ended")
		}
	})
}

// orderPaidMsg is an OrderPaid as the order service's relay publishes it.
func orderPaidMsg(eventID, orderID uuid.UUID, seq int64, version int) *nats.Msg {
	data, _ := json.Marshal(map[string]any{
		"order_id":   orderID,
		"payment_id": uuid.New(),
		"amount":     3998,
		"items":      []Item{{SKU: "SKU-1", Quantity: 2}},
	})
	m := nats.NewMsg("orders." + orderID.String() + "." + typeOrderPaid)
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, eventID.String())
	m.Header.Set("Event-Type", typeOrderPaid)
	m.Header.Set("Aggregate-Type", "order")
	m.Header.Set("Aggregate-Id", orderID.String())
	m.Header.Set("Aggregate-Seq", strconv.FormatInt(seq, 10))
	m.Header.Set("Schema-Version", strconv.Itoa(version))
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339))
	return m
}

func publish(t *testing.T, js jetstream.JetStream, m *nats.Msg) {
	t.Helper()
	natstest.Publish(t, js, m)
}

// startDirect applies an OrderPaid through the inbox handler in a
// transaction of its own, without any consumer or scanner running.
func startDirect(t *testing.T, s *Service, orderID uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	m := orderPaidMsg(uuid.New(), orderID, 1, 1)
	err = s.handle(ctx, tx, inbox.Message{
		EventID: uuid.New(), Type: typeOrderPaid, AggregateType: "order", AggregateID: orderID.String(),
		Seq: 1, SchemaVersion: 1, OccurredAt: time.Now(), Subject: m.Subject, Header: m.Header, Data: m.Data,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

type outboxRow struct {
	Seq     int64
	Subject string
	Payload json.RawMessage
}

// events returns the outbox events of type typ for orderID, in sequence order.
func events(t *testing.T, pool *pgxpool.Pool, orderID uuid.UUID, typ string) []outboxRow {
	t.Helper()
	var out []outboxRow
	for _, rec := range outboxtest.Written(t, pool, outboxtest.Want{AggregateType: "order", AggregateID: orderID.String(), Type: typ}) {
		out = append(out, outboxRow{Seq: rec.Seq, Subject: rec.Subject, Payload: json.RawMessage(rec.Payload)})
	}
	return out
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func shipmentState(t *testing.T, s *Service, orderID uuid.UUID) string {
	t.Helper()
	sh, err := s.Shipment(context.Background(), orderID)
	if errors.Is(err, ErrNotFound) {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	return sh.State
}

func TestOrderPaidStartsAndDeliversShipment(t *testing.T) {
	t.Parallel()
	e := setup(t)
	s := e.service(t)
	run(t, s)
	// A relay too, to see the events leave through the outbox with the
	// contract's subject and headers.
	relay, err := outbox.NewRelay(s.pool, e.js, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	relayDone := make(chan struct{})
	go func() { defer close(relayDone); _ = relay.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-relayDone })

	orderID := uuid.New()
	publish(t, e.js, orderPaidMsg(uuid.New(), orderID, 1, 1))

	poll.Until(t, 10*time.Second, "the shipment to start", func() bool { return shipmentState(t, s, orderID) != "" })
	started := events(t, s.pool, orderID, typeFulfillmentStarted)
	if len(started) != 1 {
		t.Fatalf("FulfillmentStarted events = %d, want 1", len(started))
	}
	var fs FulfillmentStarted
	if err := json.Unmarshal(started[0].Payload, &fs); err != nil {
		t.Fatal(err)
	}
	sh, err := s.Shipment(context.Background(), orderID)
	if err != nil {
		t.Fatal(err)
	}
	if fs.OrderID != orderID || fs.ShipmentID != sh.ShipmentID || len(fs.Items) != 1 || fs.Items[0] != (Item{"SKU-1", 2}) {
		t.Errorf("FulfillmentStarted = %+v, shipment %s", fs, sh.ShipmentID)
	}
	if want := "fulfillment." + orderID.String() + ".FulfillmentStarted"; started[0].Subject != want || started[0].Seq != 1 {
		t.Errorf("FulfillmentStarted subject %q seq %d, want %q seq 1", started[0].Subject, started[0].Seq, want)
	}
	if got := sh.DeliverAt.Sub(sh.StartedAt); got != testDelay {
		t.Errorf("deliver_at - started_at = %s, want %s", got, testDelay)
	}

	poll.Until(t, 10*time.Second, "the delivery", func() bool { return shipmentState(t, s, orderID) == StateDelivered })
	delivered := events(t, s.pool, orderID, typeShipmentDelivered)
	if len(delivered) != 1 || delivered[0].Seq != 2 {
		t.Fatalf("ShipmentDelivered events = %+v, want one with seq 2", delivered)
	}
	var sd ShipmentDelivered
	if err := json.Unmarshal(delivered[0].Payload, &sd); err != nil {
		t.Fatal(err)
	}
	sh, _ = s.Shipment(context.Background(), orderID)
	if sd.OrderID != orderID || sd.ShipmentID != sh.ShipmentID || sh.DeliveredAt == nil || !sd.DeliveredAt.Equal(*sh.DeliveredAt) {
		t.Errorf("ShipmentDelivered = %+v, shipment %+v", sd, sh)
	}
	if sh.DeliveredAt.Before(sh.DeliverAt) {
		t.Errorf("delivered at %s, before it was due at %s", sh.DeliveredAt, sh.DeliverAt)
	}

	// Both events reach the FULFILLMENT stream, in order, with the headers.
	st, err := e.js.Stream(context.Background(), "FULFILLMENT")
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "both events on FULFILLMENT", func() bool {
		info, err := st.Info(context.Background())
		return err == nil && info.State.Msgs == 2
	})
	for seq, typ := range map[uint64]string{1: typeFulfillmentStarted, 2: typeShipmentDelivered} {
		msg, err := st.GetMsg(context.Background(), seq)
		if err != nil {
			t.Fatal(err)
		}
		h := msg.Header
		if msg.Subject != "fulfillment."+orderID.String()+"."+typ || h.Get("Event-Type") != typ ||
			h.Get("Aggregate-Id") != orderID.String() || h.Get("Aggregate-Seq") != strconv.FormatUint(seq, 10) ||
			h.Get("Schema-Version") != "1" {
			t.Errorf("message %d: subject %q headers %v", seq, msg.Subject, h)
		}
	}
}

func TestDuplicateOrderPaidIsNoOp(t *testing.T) {
	t.Parallel()
	e := setup(t)
	s := e.service(t)
	run(t, s)

	orderID := uuid.New()
	first := orderPaidMsg(uuid.New(), orderID, 1, 1)
	publish(t, e.js, first)
	publish(t, e.js, first) // the same event again: a relay retry
	// Another event id for the same order: a second OrderPaid must not start
	// a second shipment.
	publish(t, e.js, orderPaidMsg(uuid.New(), orderID, 2, 1))

	poll.Until(t, 10*time.Second, "both OrderPaid events processed", func() bool {
		return len(inboxtest.Processed(t, s.pool, ConsumerName)) == 2
	})
	poll.Until(t, 10*time.Second, "the delivery", func() bool { return shipmentState(t, s, orderID) == StateDelivered })
	if n := count(t, s.pool, `SELECT count(*) FROM shipments`); n != 1 {
		t.Errorf("shipments = %d, want 1", n)
	}
	if n := len(events(t, s.pool, orderID, typeFulfillmentStarted)); n != 1 {
		t.Errorf("FulfillmentStarted events = %d, want 1", n)
	}
	if n := len(events(t, s.pool, orderID, typeShipmentDelivered)); n != 1 {
		t.Errorf("ShipmentDelivered events = %d, want 1", n)
	}
}

func TestOtherEventsAreNotDeliveredAndUnknownVersionsArePoison(t *testing.T) {
	t.Parallel()
	e := setup(t)
	s := e.service(t)
	run(t, s)

	ignored := uuid.New()
	m := orderPaidMsg(uuid.New(), ignored, 1, 1)
	m.Subject = "orders." + ignored.String() + ".OrderCreated"
	m.Header.Set("Event-Type", "OrderCreated")
	publish(t, e.js, m)
	poisoned := uuid.New()
	publish(t, e.js, orderPaidMsg(uuid.New(), poisoned, 1, 2))

	poll.Until(t, 10*time.Second, "OrderPaid v2 dead-lettered", func() bool {
		dead, err := inbox.ListDeadLetters(context.Background(), s.pool, ConsumerName, 10)
		if err != nil {
			t.Fatal(err)
		}
		return len(dead) == 1
	})
	// The filter keeps OrderCreated away: never delivered, never recorded.
	if n := len(inboxtest.Processed(t, s.pool, ConsumerName)); n != 0 {
		t.Errorf("%d events processed, want 0", n)
	}
	if lag, err := s.consumer.Lag(context.Background()); err != nil || lag != 0 {
		t.Errorf("consumer lag = %d, %v; want 0 (OrderCreated is not its to settle)", lag, err)
	}
	if n := count(t, s.pool, `SELECT count(*) FROM shipments`); n != 0 {
		t.Errorf("shipments = %d, want 0", n)
	}
	outboxtest.RequireNotWritten(t, s.pool, outboxtest.Want{})
}

func TestShipmentDueWhileDownIsDeliveredOnStart(t *testing.T) {
	t.Parallel()
	e := setup(t)
	down := e.service(t) // never Run: no scanner while the shipment falls due
	orderID := uuid.New()
	startDirect(t, down, orderID)

	poll.Until(t, 10*time.Second, "the shipment to fall due", func() bool {
		return count(t, down.pool, `SELECT count(*) FROM shipments WHERE deliver_at <= now()`) == 1
	})
	if got := shipmentState(t, down, orderID); got != StateStarted {
		t.Fatalf("state before any scanner ran = %q, want STARTED", got)
	}

	up := e.service(t)
	run(t, up)
	poll.Until(t, 10*time.Second, "the delivery after restart", func() bool { return shipmentState(t, up, orderID) == StateDelivered })
	if n := len(events(t, up.pool, orderID, typeShipmentDelivered)); n != 1 {
		t.Errorf("ShipmentDelivered events = %d, want 1", n)
	}
}

func TestConcurrentScannersDeliverEachShipmentOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	seed := e.service(t)
	const orders = 300
	ids := make([]uuid.UUID, orders)
	for i := range ids {
		ids[i] = uuid.New()
		startDirect(t, seed, ids[i])
	}

	// Two instances scanning the same rows, plus a few bare scanner loops
	// hammering the claim, so that claims really overlap.
	a, b := e.service(t), e.service(t)
	run(t, a)
	run(t, b)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for _, s := range []*Service{a, b} {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := s.deliverDue(context.Background()); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	poll.Until(t, 20*time.Second, "every shipment delivered", func() bool {
		return count(t, seed.pool, `SELECT count(*) FROM shipments WHERE state = 'DELIVERED'`) == orders
	})
	close(stop)
	wg.Wait()

	delivered := map[string]int{}
	for _, rec := range outboxtest.Written(t, seed.pool, outboxtest.Want{Type: typeShipmentDelivered}) {
		delivered[rec.AggregateID]++
	}
	if len(delivered) != orders {
		t.Errorf("ShipmentDelivered for %d orders, want %d", len(delivered), orders)
	}
	for order, n := range delivered {
		if n != 1 {
			t.Errorf("order %s has %d ShipmentDelivered, want 1", order, n)
		}
	}
}

func TestGetShipment(t *testing.T) {
	t.Parallel()
	e := setup(t)
	s := e.service(t)
	orderID := uuid.New()
	startDirect(t, s, orderID)
	r := chi.NewRouter()
	s.Routes(r)

	t.Run("found", func(t *testing.T) {
		rec := httptest.NewRecorder()
		r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/shipments/"+orderID.String(), nil))
		if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "application/json" {
			t.Fatalf("status %d, content type %q: %s", rec.Code, rec.Header().Get("Content-Type"), rec.Body)
		}
		var body map[string]any
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"order_id", "shipment_id", "state", "started_at", "deliver_at", "delivered_at"} {
			if _, ok := body[k]; !ok {
				t.Errorf("response lacks %q: %s", k, rec.Body)
			}
		}
		if body["order_id"] != orderID.String() || body["state"] != StateStarted || body["delivered_at"] != nil {
			t.Errorf("body = %s", rec.Body)
		}
	})
	for name, id := range map[string]string{"unknown order": uuid.NewString(), "not a uuid": "nope"} {
		t.Run(name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/shipments/"+id, nil))
			var p struct {
				Status int    `json:"status"`
				Code   string `json:"code"`
			}
			_ = json.Unmarshal(rec.Body.Bytes(), &p)
			if rec.Code != http.StatusNotFound || rec.Header().Get("Content-Type") != "application/problem+json" ||
				p.Status != http.StatusNotFound || p.Code != "shipment-not-found" {
				t.Errorf("status %d, content type %q: %s", rec.Code, rec.Header().Get("Content-Type"), rec.Body)
			}
		})
	}
}

// A scan begins its transaction in the batch of its claim, so the scan that
// finds nothing due must end it as surely as the one that delivers: an idle
// scanner polls often and would soon hold every connection of the pool.
func TestDeliverDueGivesItsConnectionBack(t *testing.T) {
	t.Parallel()
	s := setup(t).service(t) // not running: these scans are the pool's only users
	orderID := uuid.New()
	scan := func(want int) {
		t.Helper()
		if n, err := s.deliverDue(context.Background()); err != nil || n != want {
			t.Fatalf("deliverDue: %d, %v; want %d", n, err, want)
		}
		poll.Until(t, 10*time.Second, "the scan's connection released", func() bool {
			return s.pool.Stat().AcquiredConns() == 0
		})
	}
	scan(0) // no shipment at all
	startDirect(t, s, orderID)
	poll.Until(t, 10*time.Second, "the shipment due", func() bool {
		return count(t, s.pool, `SELECT count(*) FROM shipments WHERE deliver_at <= now()`) == 1
	})
	scan(1)
	scan(0) // delivered already
	if got := shipmentState(t, s, orderID); got != StateDelivered {
		t.Fatalf("shipment %s, want %s", got, StateDelivered)
	}
}
