package reconcile_test

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/natstest"
	"github.com/shop-ref/shop/internal/reconcile"
	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/inboxtest"
	"github.com/shop-ref/shop/pkg/outbox"
)

const retention = 72 * time.Hour

// ordersConsumers are the consumers of ORDERS that read every event type,
// with the schema each records in. Their handlers apply a stand-in business
// effect: a row in effects, in the inbox transaction.
var ordersConsumers = []string{"inventory-orders", "payment-orders"}

// lostShop is the order service's side of the shop for real — its schema,
// a relay publishing its outbox to ORDERS on a real NATS server — and the two
// consumers of every ORDERS event (inventory-orders, payment-orders) with a
// handler that counts what they applied, in the inventory and payment
// schemas. The other streams exist, empty, as the services create them.
type lostShop struct {
	*shop
	nats *natstest.Server
	js   jetstream.JetStream
	w    outbox.Writer
}

func newLostShop(t *testing.T) *lostShop {
	t.Helper()
	s := &lostShop{shop: newShop(t), nats: natstest.New(t)}
	_, s.js = s.nats.Connect(t)
	for name, subjects := range map[string]string{"ORDERS": "orders.>", "INVENTORY": "inventory.>", "PAYMENT": "payment.>", "FULFILLMENT": "fulfillment.>"} {
		s.nats.Stream(t, s.js, name, subjects)
	}
	for _, pool := range []*pgxpool.Pool{s.pools.Inventory, s.pools.Payment} {
		s.exec(pool, `CREATE TABLE effects (applied bigint GENERATED ALWAYS AS IDENTITY,
			consumer text NOT NULL, event_id uuid NOT NULL, aggregate text NOT NULL, seq bigint NOT NULL)`)
	}
	relay, err := outbox.NewRelay(s.pools.Order, s.js, outbox.Config{Name: "order-relay", PollInterval: 20 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	s.background(relay.Run)
	return s
}

// background runs f until the test ends.
func (s *lostShop) background(f func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			s.t.Errorf("background: %v", err)
		}
	}
	s.t.Cleanup(stop)
	return stop
}

// startConsumers runs the two ORDERS consumers until stop is called.
func (s *lostShop) startConsumers() (consumers []*inbox.Consumer, stop func()) {
	s.t.Helper()
	var stops []func()
	for i, name := range ordersConsumers {
		pool := []*pgxpool.Pool{s.pools.Inventory, s.pools.Payment}[i]
		c, err := inbox.NewConsumer(pool, s.js, inbox.Config{
			Name: name, Stream: "ORDERS", Workers: 2, DuplicateWindow: broker.DuplicateWindow,
			Logger: slog.New(slog.DiscardHandler),
			Handler: func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
				_, err := tx.Exec(ctx, `INSERT INTO effects (consumer, event_id, aggregate, seq) VALUES ($1, $2, $3, $4)`,
					name, m.EventID, m.AggregateID, m.Seq)
				return err
			},
		})
		if err != nil {
			s.t.Fatal(err)
		}
		consumers = append(consumers, c)
		stops = append(stops, s.background(c.Run))
	}
	return consumers, func() {
		for _, stop := range stops {
			stop()
		}
	}
}

// place commits a new order with its OrderCreated, as the order service
// does, and returns the order id and the event id.
func (s *lostShop) place() (string, uuid.UUID) {
	s.t.Helper()
	id := uuid.NewString()
	ev := uuid.Must(uuid.NewV7())
	s.tx(func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at) VALUES ($1, 'c-1', 'PENDING', 1000, now(), now())`, id); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO order_history (order_id, status, at) VALUES ($1, 'PENDING', now())`, id); err != nil {
			return err
		}
		return s.w.Add(ctx, tx, outbox.Event{ID: ev, AggregateType: "order", AggregateID: id, Type: "OrderCreated",
			Subject: "orders." + id + ".OrderCreated", Payload: map[string]string{"order_id": id}})
	})
	return id, ev
}

// awaitPayment moves order id to WAIT_PAY with its OrderAwaitingPayment, the
// aggregate's second event, and returns the event id.
func (s *lostShop) awaitPayment(id string) uuid.UUID {
	s.t.Helper()
	ev := uuid.Must(uuid.NewV7())
	s.tx(func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'WAIT_PAY', updated_at = now() WHERE order_id = $1`, id); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO order_history (order_id, status, at) VALUES ($1, 'WAIT_PAY', now())`, id); err != nil {
			return err
		}
		return s.w.Add(ctx, tx, outbox.Event{ID: ev, AggregateType: "order", AggregateID: id, Type: "OrderAwaitingPayment",
			Subject: "orders." + id + ".OrderAwaitingPayment", Payload: map[string]string{"order_id": id}})
	})
	return ev
}

func (s *lostShop) tx(f func(context.Context, pgx.Tx) error) {
	s.t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, s.pools.Order, func(tx pgx.Tx) error { return f(ctx, tx) }); err != nil {
		s.t.Fatal(err)
	}
}

func (s *lostShop) count(pool *pgxpool.Pool, sql string, args ...any) int {
	s.t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		s.t.Fatal(err)
	}
	return n
}

// applied counts the effects and processed_events rows of event ev in both
// consumers' schemas: each is 2 when both applied it once.
func (s *lostShop) applied(ev uuid.UUID) (effects, processed int) {
	s.t.Helper()
	for i, pool := range []*pgxpool.Pool{s.pools.Inventory, s.pools.Payment} {
		effects += s.count(pool, `SELECT count(*) FROM effects WHERE event_id = $1`, ev)
		if slices.Contains(inboxtest.Processed(s.t, pool, ordersConsumers[i]), ev) {
			processed++
		}
	}
	return effects, processed
}

func (s *lostShop) eventually(what string, cond func() bool) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			s.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// streamSeq is the stream sequence of the last message on subject in ORDERS.
func (s *lostShop) streamSeq(subject string) uint64 {
	s.t.Helper()
	st, err := s.js.Stream(context.Background(), "ORDERS")
	if err != nil {
		s.t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(context.Background(), subject)
	if err != nil {
		s.t.Fatalf("%s: %v", subject, err)
	}
	return m.Sequence
}

// TestRepairRepublishesWhatTheStreamLost: messages deleted from ORDERS
// behind the shop's back — one the consumers had applied, the next of the
// same order and the first of another that no consumer had seen yet — are
// found by the stream audit, republished by the reconciler with their ids
// and sequences, and applied exactly once.
func TestRepairRepublishesWhatTheStreamLost(t *testing.T) {
	s := newLostShop(t)
	ctx := context.Background()

	// Order X is created and both consumers apply its OrderCreated.
	x, created := s.place()
	_, stopConsumers := s.startConsumers()
	s.eventually("OrderCreated applied", func() bool { e, p := s.applied(created); return e == 2 && p == 2 })
	// With the consumers stopped, X awaits payment and order Y is created:
	// both published, neither seen by a consumer.
	stopConsumers()
	awaiting := s.awaitPayment(x)
	y, createdY := s.place()
	s.eventually("every event published", func() bool {
		st, err := outbox.ReadStats(context.Background(), s.pools.Order)
		return err == nil && st.Pending == 0
	})

	// The broker loses the three messages. A broker that loses them in a
	// crash also forgets their ids; DeleteMsg leaves them in the duplicate
	// window, which would drop the copies, so the test restarts the server,
	// which rebuilds that window from what it stored.
	st, err := s.js.Stream(ctx, "ORDERS")
	if err != nil {
		t.Fatal(err)
	}
	for _, subject := range []string{"orders." + x + ".OrderCreated", "orders." + x + ".OrderAwaitingPayment", "orders." + y + ".OrderCreated"} {
		if err := st.DeleteMsg(ctx, s.streamSeq(subject)); err != nil {
			t.Fatal(err)
		}
	}
	s.nats.Stop()
	s.nats.Start()

	// verify names each of them: service, event id, aggregate, seq. The
	// audit leaves out events marked published in its last few seconds
	// (verify.AuditConfig.Grace), so it names them once those have passed.
	var b strings.Builder
	var streamCheck *verify.Check
	s.eventually("verify to name the lost events", func() bool {
		report, err := verify.Run(ctx, s.shop.shop, retention, verify.WithStreams(s.js))
		if err != nil {
			t.Fatal(err)
		}
		for i, c := range report.Checks {
			if c.Name == "order: stream ORDERS holds every event marked published" && len(c.Violations) > 0 {
				streamCheck = &report.Checks[i]
			}
		}
		b.Reset()
		report.Write(&b)
		return streamCheck != nil && len(streamCheck.Violations) == 3
	})
	if streamCheck.Invariant != 3 {
		t.Fatalf("the stream audit is not invariant 3:\n%s", b.String())
	}
	for i, want := range []struct {
		ev  uuid.UUID
		agg string
		seq string
	}{{created, x, "seq 1"}, {awaiting, x, "seq 2"}, {createdY, y, "seq 1"}} {
		found := false
		for _, v := range streamCheck.Violations {
			found = found || (strings.HasPrefix(v, "order: ") && strings.Contains(v, want.ev.String()) &&
				strings.Contains(v, "order "+want.agg+", "+want.seq))
		}
		if !found {
			t.Errorf("lost event %d (%s, %s %s) is not named:\n%s", i, want.ev, want.agg, want.seq, b.String())
		}
	}

	// The reconciler republishes them.
	rep, err := reconcile.Run(ctx, s.shop.shop, reconcile.Config{Repair: true, JetStream: s.js, Retention: retention})
	if err != nil {
		t.Fatal(err)
	}
	b.Reset()
	rep.Write(&b)
	t.Log("\n" + b.String())
	if rep.Counts.LostEvents != 3 || rep.Counts.Republished != 3 || len(found(rep, reconcile.LostEvent)) != 3 {
		t.Fatalf("reconcile: %+v, want 3 lost events, 3 republished", rep.Counts)
	}
	for _, f := range rep.Findings {
		if f.Kind == reconcile.LostEvent && (f.Republished != 1 || f.Event == nil || f.Event.Service != "order") {
			t.Errorf("finding %v: want its order event republished", f)
		}
	}

	// The consumers come back: the copy of X's OrderCreated is absorbed,
	// the other two are applied, and every invariant holds.
	consumers, _ := s.startConsumers()
	report, err := verify.Wait(ctx, s.shop.shop, retention, 30*time.Second, verify.WithStreams(s.js))
	if err != nil {
		t.Fatal(err)
	}
	if !report.OK() {
		b.Reset()
		report.Write(&b)
		t.Fatalf("invariants after the repair:\n%s", b.String())
	}
	for _, name := range ordersConsumers {
		s.eventually(name+" settled", func() bool { return natstest.Settled(t, s.js, "ORDERS", name) })
	}
	for _, ev := range []uuid.UUID{created, awaiting, createdY} {
		if e, p := s.applied(ev); e != 2 || p != 2 {
			t.Errorf("event %s: %d effects and %d processed_events rows over both consumers, want 2 and 2", ev, e, p)
		}
	}
	for i, pool := range []*pgxpool.Pool{s.pools.Inventory, s.pools.Payment} {
		if n := s.count(pool, `SELECT count(*) FROM effects`); n != 3 {
			t.Errorf("%s applied %d effects, want 3", ordersConsumers[i], n)
		}
		// X's events in sequence order, once each.
		var seqs []int64
		rows, err := pool.Query(ctx, `SELECT seq FROM effects WHERE aggregate = $1 ORDER BY applied`, x)
		if err != nil {
			t.Fatal(err)
		}
		if seqs, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(seqs, []int64{1, 2}) {
			t.Errorf("%s applied order X's events %v, want [1 2]", ordersConsumers[i], seqs)
		}
		if c := consumers[i].Counters(); c.Duplicates < 1 || c.DeadLetters != 0 {
			t.Errorf("%s after the repair: %+v, want the copy of OrderCreated absorbed as a duplicate", ordersConsumers[i], c)
		}
	}
}
