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

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/ops/reconcile"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/inboxtest"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

const retention = 72 * time.Hour

// ordersConsumers are the consumers of ORDERS that read every event type
// (inventory-orders, payment-orders, and any a new service adds), each
// recording in its service's schema. The test's handlers apply a stand-in
// business effect: a row in effects, in the inbox transaction.
var ordersConsumers = func() []registry.Reader {
	var readers []registry.Reader
	for _, r := range services.All.Readers() {
		if r.Stream == "ORDERS" && len(r.Types) == 0 {
			readers = append(readers, r)
		}
	}
	return readers
}()

// lostShop is the order service's side of the shop for real — its schema,
// a relay publishing its outbox to ORDERS on a real NATS server — and the
// consumers of every ORDERS event (ordersConsumers) with a handler that
// counts what they applied, each in its service's schema. The other streams exist, empty, as the services create them.
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
	for _, a := range services.All.Access() {
		s.nats.Stream(t, s.js, a.Stream, a.Subjects...)
	}
	for _, r := range ordersConsumers {
		s.exec(s.shop.shop.Pools[r.Service], `CREATE TABLE effects (applied bigint GENERATED ALWAYS AS IDENTITY,
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

// startConsumers runs the ORDERS consumers until stop is called.
func (s *lostShop) startConsumers() (consumers []*inbox.Consumer, stop func()) {
	s.t.Helper()
	var stops []func()
	for _, r := range ordersConsumers {
		name := r.Name
		c, err := inbox.NewConsumer(s.shop.shop.Pools[r.Service], s.js, inbox.Config{
			Name: name, Stream: "ORDERS", Workers: 2,
			Logger: slog.New(slog.DiscardHandler),
			Handler: inbox.Each(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
				_, err := tx.Exec(ctx, `INSERT INTO effects (consumer, event_id, aggregate, seq) VALUES ($1, $2, $3, $4)`,
					name, m.EventID, m.AggregateID, m.Seq)
				return err
			}),
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

// applied counts the effects and processed_events rows of event ev in the
// consumers' schemas: each is len(ordersConsumers) when every one applied
// it once.
func (s *lostShop) applied(ev uuid.UUID) (effects, processed, consumers int) {
	s.t.Helper()
	for _, r := range ordersConsumers {
		pool := s.shop.shop.Pools[r.Service]
		effects += s.count(pool, `SELECT count(*) FROM effects WHERE event_id = $1`, ev)
		if slices.Contains(inboxtest.Processed(s.t, pool, r.Name), ev) {
			processed++
		}
	}
	return effects, processed, len(ordersConsumers)
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
	poll.Until(s.t, 30*time.Second, "OrderCreated applied", func() bool { e, p, n := s.applied(created); return e == n && p == n })
	// With the consumers stopped, X awaits payment and order Y is created:
	// both published, neither seen by a consumer.
	stopConsumers()
	awaiting := s.awaitPayment(x)
	y, createdY := s.place()
	poll.Until(s.t, 30*time.Second, "every event published", func() bool {
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
	poll.Until(s.t, 30*time.Second, "verify to name the lost events", func() bool {
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
	for _, r := range ordersConsumers {
		poll.Until(s.t, 30*time.Second, r.Name+" settled", func() bool { return natstest.Settled(t, s.js, "ORDERS", r.Name) })
	}
	for _, ev := range []uuid.UUID{created, awaiting, createdY} {
		if e, p, n := s.applied(ev); e != n || p != n {
			t.Errorf("event %s: %d effects and %d processed_events rows over the %d consumers, want %d and %d", ev, e, p, n, n, n)
		}
	}
	for i, r := range ordersConsumers {
		pool := s.shop.shop.Pools[r.Service]
		if n := s.count(pool, `SELECT count(*) FROM effects`); n != 3 {
			t.Errorf("%s applied %d effects, want 3", r.Name, n)
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
			t.Errorf("%s applied order X's events %v, want [1 2]", r.Name, seqs)
		}
		if c := consumers[i].Counters(); c.Duplicates < 1 || c.DeadLetters != 0 {
			t.Errorf("%s after the repair: %+v, want the copy of OrderCreated absorbed as a duplicate", r.Name, c)
		}
	}
}
