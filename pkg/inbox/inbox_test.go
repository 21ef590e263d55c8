package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/inbox/migrations"
	"github.com/shop-ref/shop/pkg/internal/testenv"
)

const (
	testStream   = "ORDERS"
	testConsumer = "payment"
)

// env is one test's world: its own schema, its own NATS server with an
// ORDERS stream, and an effects table the handlers write to.
type env struct {
	db   *testenv.Schema
	pool *pgxpool.Pool // the consumer's: Workers+2 connections, as documented
	nats *testenv.Server
	js   jetstream.JetStream
}

func setup(t testing.TB) *env {
	t.Helper()
	db := testenv.New(t, testenv.Migrations{Table: "inbox_goose_version", FS: migrations.FS()})
	if _, err := db.Pool.Exec(context.Background(), `
		CREATE TABLE effects (
			id           bigserial PRIMARY KEY,
			instance     text   NOT NULL,
			event_id     uuid   NOT NULL,
			aggregate_id text   NOT NULL,
			seq          bigint NOT NULL
		)`); err != nil {
		t.Fatal(err)
	}
	srv := testenv.NATS(t)
	_, js := srv.Connect(t)
	srv.Stream(t, js, testStream, "orders.>")
	return &env{db: db, pool: db.NewPool(t, 6), nats: srv, js: js}
}

// config is a Config with delays short enough for tests.
func (e *env) config(t testing.TB, h EventFunc) Config {
	return Config{
		Name:        testConsumer,
		Stream:      testStream,
		Handler:     Each(h),
		Workers:     4,
		BackoffBase: 10 * time.Millisecond,
		BackoffMax:  200 * time.Millisecond,
		AckWait:     5 * time.Second,
		Logger:      slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
}

func (e *env) consumer(t testing.TB, pool *pgxpool.Pool, js jetstream.JetStream, cfg Config) *Consumer {
	t.Helper()
	c, err := NewConsumer(pool, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// run runs c until the test ends and checks that Run then returns cleanly.
func run(t testing.TB, c *Consumer) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("Run did not return after its context ended")
		}
	})
}

// record is a handler that writes the event to effects in the inbox tx.
func record(instance string) EventFunc {
	return func(ctx context.Context, tx pgx.Tx, m Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (instance, event_id, aggregate_id, seq) VALUES ($1, $2, $3, $4)`,
			instance, m.EventID, m.AggregateID, m.Seq)
		return err
	}
}

type event struct {
	id  uuid.UUID
	agg string
	seq int64
	typ string
}

func newEvent(agg string, seq int64) event {
	return event{id: uuid.New(), agg: agg, seq: seq, typ: "OrderCreated"}
}

// msg builds the message the outbox relay would publish for ev.
func (ev event) msg() *nats.Msg {
	m := nats.NewMsg("orders." + ev.agg + "." + ev.typ)
	m.Header.Set(jetstream.MsgIDHeader, ev.id.String())
	m.Header.Set("Event-Type", ev.typ)
	m.Header.Set("Aggregate-Type", "order")
	m.Header.Set("Aggregate-Id", ev.agg)
	m.Header.Set("Aggregate-Seq", strconv.FormatInt(ev.seq, 10))
	m.Header.Set("Schema-Version", "1")
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339Nano))
	m.Data = []byte(`{"order_id":"` + ev.agg + `"}`)
	return m
}

func (e *env) publish(t *testing.T, evs ...event) {
	t.Helper()
	for _, ev := range evs {
		e.publishMsg(t, ev.msg())
	}
}

func (e *env) publishMsg(t *testing.T, m *nats.Msg) *jetstream.PubAck {
	t.Helper()
	return testenv.Publish(t, e.js, m)
}

// eventually waits for cond, polling; it fails the test after 30s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// settled reports whether the durable consumer has acked (or terminated)
// every message in the stream.
func (e *env) settled(t *testing.T) bool {
	t.Helper()
	return testenv.Settled(t, e.js, testStream, testConsumer)
}

// seqs returns the sequences applied for agg, in the order they committed.
func (e *env) seqs(t *testing.T, agg string) []int64 {
	t.Helper()
	rows, err := e.db.Pool.Query(context.Background(), `SELECT seq FROM effects WHERE aggregate_id = $1 ORDER BY id`, agg)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (e *env) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := e.db.Pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

func wantSeqs(t *testing.T, e *env, agg string, want ...int64) {
	t.Helper()
	if got := e.seqs(t, agg); !slices.Equal(got, want) {
		t.Fatalf("effects of %s: got seqs %v, want %v", agg, got, want)
	}
}

func TestAppliesEachEventOnceInOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	run(t, e.consumer(t, e.pool, e.js, e.config(t, record(""))))

	e.publish(t, newEvent("a", 1), newEvent("b", 1), newEvent("a", 2), newEvent("a", 3))
	eventually(t, "all messages are acked", func() bool { return e.settled(t) })

	wantSeqs(t, e, "a", 1, 2, 3)
	wantSeqs(t, e, "b", 1)
	if n := e.count(t, `SELECT count(*) FROM processed_events WHERE consumer_name = $1`, testConsumer); n != 4 {
		t.Errorf("processed_events: %d rows, want 4", n)
	}
	if n := e.count(t, `SELECT last_seq FROM inbox_sequences WHERE consumer_name = $1 AND source = 'orders' AND aggregate_id = 'a'`, testConsumer); n != 3 {
		t.Errorf("cursor of a: %d, want 3", n)
	}
}

// republish publishes ev again once the stream's duplicate window has let
// go of its Nats-Msg-Id: a relay republishing after a lost PubAck, late.
func (e *env) republish(t *testing.T, ev event) {
	t.Helper()
	eventually(t, "the stream stores a second copy", func() bool {
		return !e.publishMsg(t, ev.msg()).Duplicate
	})
}

func shortDuplicateWindow(t *testing.T, e *env) {
	t.Helper()
	if _, err := e.js.UpdateStream(context.Background(), jetstream.StreamConfig{
		Name: testStream, Subjects: []string{"orders.>"}, Storage: jetstream.FileStorage,
		Duplicates: 100 * time.Millisecond,
	}); err != nil {
		t.Fatal(err)
	}
}

func TestDuplicateDeliveryAppliedOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	shortDuplicateWindow(t, e)
	var observed atomic.Int32
	cfg := e.config(t, record(""))
	cfg.Hooks.ObserveFunc = func(consumer string, d time.Duration) {
		if consumer == testConsumer && d > 0 {
			observed.Add(1)
		}
	}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)

	ev := newEvent("a", 1)
	e.publish(t, ev)
	eventually(t, "the event is applied", func() bool { return len(e.seqs(t, "a")) == 1 })
	e.republish(t, ev)
	eventually(t, "the copy is acked", func() bool { return e.settled(t) })

	wantSeqs(t, e, "a", 1)
	eventually(t, "the copy is counted", func() bool { return c.Counters().Duplicates == 1 })
	if got := c.Counters(); got != (Counters{Processed: 1, Duplicates: 1}) {
		t.Errorf("counters %+v, want 1 processed and 1 duplicate", got)
	}
	if n := observed.Load(); n != 2 {
		t.Errorf("ObserveFunc called %d times, want 2 (the event and its copy)", n)
	}
	if lag, err := c.Lag(context.Background()); err != nil || lag != 0 {
		t.Errorf("Lag = %d, %v; want 0 once settled", lag, err)
	}
}

func TestReplayOlderThanRetentionSkippedBySequence(t *testing.T) {
	t.Parallel()
	e := setup(t)
	shortDuplicateWindow(t, e)
	run(t, e.consumer(t, e.pool, e.js, e.config(t, record(""))))

	ev := newEvent("a", 1)
	e.publish(t, ev)
	eventually(t, "the event is applied", func() bool { return len(e.seqs(t, "a")) == 1 })
	// Retention has passed: the inbox row is gone, the cursor stays.
	if _, err := deleteProcessed(context.Background(), e.db.Pool, testConsumer, 0, 10); err != nil {
		t.Fatal(err)
	}
	e.republish(t, ev)
	eventually(t, "the copy is acked", func() bool { return e.settled(t) })

	wantSeqs(t, e, "a", 1)
}

func TestTransientErrorIsRetried(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var calls atomic.Int32
	c := e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		if calls.Add(1) <= 2 {
			return errors.New("database hiccup")
		}
		return record("")(ctx, tx, m)
	}))
	run(t, c)

	e.publish(t, newEvent("a", 1))
	eventually(t, "the message is acked", func() bool { return e.settled(t) })

	wantSeqs(t, e, "a", 1)
	if n := calls.Load(); n != 3 {
		t.Errorf("handler called %d times, want 3", n)
	}
	if n := e.count(t, `SELECT count(*) FROM inbox_failures`); n != 0 {
		t.Errorf("%d inbox_failures rows left after success", n)
	}
	if n := e.count(t, `SELECT count(*) FROM dead_letters`); n != 0 {
		t.Errorf("%d dead letters, want none", n)
	}
}

func TestUndecodableMessageIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := setup(t)
	run(t, e.consumer(t, e.pool, e.js, e.config(t, record(""))))

	noSeq := newEvent("x", 1).msg()
	noSeq.Header.Del("Aggregate-Seq")
	badID := newEvent("y", 1).msg()
	badID.Header.Set(jetstream.MsgIDHeader, "not-a-uuid")
	e.publishMsg(t, noSeq)
	e.publishMsg(t, badID)
	e.publish(t, newEvent("b", 1), newEvent("b", 2))
	eventually(t, "all messages are settled", func() bool { return e.settled(t) })

	wantSeqs(t, e, "b", 1, 2) // other aggregates are unaffected
	dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 2 {
		t.Fatalf("%d dead letters, want 2: %+v", len(dead), dead)
	}
	slices.SortFunc(dead, func(a, b DeadLetter) int { return cmp.Compare(a.StreamSeq, b.StreamSeq) })
	for _, dl := range dead {
		if !strings.Contains(dl.Error, "decode") || dl.Attempts != 1 || dl.Stream != testStream || dl.StreamSeq == 0 {
			t.Errorf("dead letter %+v", dl)
		}
	}
	if got := dead[0].Header.Get("Event-Type"); got != "OrderCreated" || len(dead[0].Data) == 0 {
		t.Errorf("dead letter lost the message: headers %v, payload %q", dead[0].Header, dead[0].Data)
	}
	if dead[0].EventID == uuid.Nil || dead[1].EventID != uuid.Nil {
		t.Errorf("event ids %s, %s: want the readable one kept and nil for the bad one", dead[0].EventID, dead[1].EventID)
	}
}

func TestPoisonErrorDeadLettersAtOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var calls atomic.Int32
	run(t, e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		if m.AggregateID == "bad" {
			calls.Add(1)
			return Poison(errors.New("unknown schema version"))
		}
		return record("")(ctx, tx, m)
	})))

	e.publish(t, newEvent("bad", 1), newEvent("ok", 1))
	eventually(t, "all messages are settled", func() bool { return e.settled(t) })

	wantSeqs(t, e, "ok", 1)
	dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].Attempts != 1 || !strings.Contains(dead[0].Error, "unknown schema version") {
		t.Fatalf("dead letters %+v, want one after one attempt", dead)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("handler called %d times for a poison event, want 1", n)
	}
}

func TestTooManyFailuresDeadLetter(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var calls atomic.Int32
	cfg := e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		if m.AggregateID == "bad" {
			calls.Add(1)
			return errors.New("payment provider down")
		}
		return record("")(ctx, tx, m)
	})
	cfg.MaxDeliver = 3
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)

	ev := newEvent("bad", 1)
	e.publish(t, ev, newEvent("ok", 1))
	eventually(t, "all messages are settled", func() bool { return e.settled(t) })
	eventually(t, "the dead letter is counted", func() bool { return c.Counters().DeadLetters == 1 })
	if got := c.Counters(); got != (Counters{Processed: 1, Retries: 2, DeadLetters: 1}) {
		t.Errorf("counters %+v, want 1 processed, 2 retries, 1 dead letter", got)
	}

	wantSeqs(t, e, "ok", 1)
	wantSeqs(t, e, "bad")
	dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	dl := dead[0]
	if dl.Attempts != 3 || dl.EventID != ev.id || !strings.Contains(dl.Error, "payment provider down") ||
		!dl.FirstFailedAt.Before(dl.LastFailedAt) || dl.Subject != "orders.bad.OrderCreated" {
		t.Errorf("dead letter %+v", dl)
	}
	if n := calls.Load(); n != 3 {
		t.Errorf("handler called %d times, want MaxDeliver = 3", n)
	}
	if n := e.count(t, `SELECT count(*) FROM inbox_failures`); n != 0 {
		t.Errorf("%d inbox_failures rows left; the dead letter should carry the count", n)
	}
}

func TestRequeuedDeadLetterUnblocksItsAggregate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var broken atomic.Bool
	broken.Store(true)
	var firstCalls atomic.Int32
	// One delivery at a time, so that the handler's calls count deliveries
	// (a batch runs a failing handler once more, alone).
	cfg := e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		if m.Seq == 1 && m.AggregateID == "a" {
			firstCalls.Add(1)
			if broken.Load() {
				return Poison(errors.New("bug in handler"))
			}
		}
		return record("")(ctx, tx, m)
	})
	cfg.BatchSize = 1
	run(t, e.consumer(t, e.pool, e.js, cfg))
	ctx := context.Background()

	e.publish(t, newEvent("a", 1), newEvent("a", 2), newEvent("a", 3), newEvent("b", 1))
	var dead []DeadLetter
	eventually(t, "event a/1 is a dead letter", func() bool {
		var err error
		dead, err = ListDeadLetters(ctx, e.db.Pool, testConsumer, 10)
		if err != nil {
			t.Fatal(err)
		}
		return len(dead) == 1
	})
	eventually(t, "b is applied", func() bool { return len(e.seqs(t, "b")) == 1 })
	wantSeqs(t, e, "a") // 2 and 3 wait behind the dead letter, parked
	eventually(t, "a/2 and a/3 are parked, and acked", func() bool {
		n, _, err := ParkedStats(ctx, e.db.Pool, testConsumer)
		return err == nil && n == 2 && e.settled(t)
	})

	broken.Store(false) // the bug is fixed
	if err := RequeueDeadLetter(ctx, e.db.Pool, dead[0].ID); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a is applied in order and everything settled", func() bool {
		return len(e.seqs(t, "a")) == 3 && e.settled(t)
	})
	wantSeqs(t, e, "a", 1, 2, 3)
	if n, _, _ := ParkedStats(ctx, e.db.Pool, testConsumer); n != 0 {
		t.Errorf("%d events still parked after the requeue, want 0", n)
	}
	if n := e.count(t, `SELECT count(*) FROM dead_letters WHERE resolved_at IS NOT NULL`); n != 1 {
		t.Errorf("%d resolved dead letters, want 1", n)
	}
	if n := firstCalls.Load(); n != 2 {
		t.Errorf("handler called %d times for a/1, want 2 (failed, then requeued)", n)
	}
	if err := RequeueDeadLetter(ctx, e.db.Pool, dead[0].ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("requeue of a resolved dead letter: %v, want ErrNotFound", err)
	}
}

func TestGapWaitsForEarlierEvent(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var order []int64
	var mu sync.Mutex
	// Seq 2 is in the stream before seq 1: a relay retry brought 1 late.
	e.publish(t, newEvent("a", 2), newEvent("a", 1))
	run(t, e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		mu.Lock()
		order = append(order, m.Seq)
		mu.Unlock()
		return record("")(ctx, tx, m)
	})))

	eventually(t, "both are applied and settled", func() bool { return e.settled(t) })
	wantSeqs(t, e, "a", 1, 2)
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(order, []int64{1, 2}) {
		t.Errorf("handler saw seqs %v, want [1 2]: seq 2 must wait for 1", order)
	}
}

func TestInstancesShareDurableAndKeepOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const aggregates, events = 30, 5
	for _, name := range []string{"one", "two"} {
		_, js := e.nats.Connect(t)
		h := record(name)
		cfg := e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
			time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond) // shuffle the timing
			return h(ctx, tx, m)
		})
		run(t, e.consumer(t, e.db.NewPool(t, int32(cfg.Workers+2)), js, cfg))
	}

	var evs []event
	for seq := int64(1); seq <= events; seq++ {
		for a := range aggregates {
			evs = append(evs, newEvent(fmt.Sprintf("agg-%02d", a), seq))
		}
	}
	e.publish(t, evs...)
	eventually(t, "every event is applied and settled", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) >= aggregates*events && e.settled(t)
	})

	if n := e.count(t, `SELECT count(DISTINCT event_id) FROM effects`); n != aggregates*events {
		t.Errorf("%d distinct events applied, want %d", n, aggregates*events)
	}
	for a := range aggregates {
		wantSeqs(t, e, fmt.Sprintf("agg-%02d", a), 1, 2, 3, 4, 5)
	}
	for _, name := range []string{"one", "two"} {
		if n := e.count(t, `SELECT count(*) FROM effects WHERE instance = $1`, name); n == 0 {
			t.Errorf("instance %s handled nothing", name)
		}
	}
}

func TestRunFinishesInFlightOnShutdown(t *testing.T) {
	t.Parallel()
	e := setup(t)
	started, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	c := e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		once.Do(func() { close(started) })
		<-release
		return record("")(ctx, tx, m)
	}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()

	e.publish(t, newEvent("a", 1))
	<-started
	cancel()
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) while a handler was still running", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	wantSeqs(t, e, "a", 1)
	eventually(t, "the message is acked", func() bool { return e.settled(t) })
}

func TestNewConsumerChecksConfig(t *testing.T) {
	t.Parallel()
	e := setup(t)
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string // "" for a valid config
	}{
		{"defaults", func(*Config) {}, ""},
		{"negative retention", func(c *Config) { c.Retention = -time.Hour }, "Retention (-1h0m0s)"},
		{"missing name", func(c *Config) { c.Name = "" }, "Name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.config(t, record(""))
			tc.edit(&cfg)
			_, err := NewConsumer(e.pool, e.js, cfg)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("valid config refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %v, want an error naming %q", err, tc.want)
			}
		})
	}

	t.Run("stream duplicate window longer than retention", func(t *testing.T) {
		// The test stream keeps ids for 10 minutes.
		cfg := e.config(t, record(""))
		cfg.Retention = 5 * time.Minute
		c := e.consumer(t, e.pool, e.js, cfg)
		err := c.Run(context.Background())
		if err == nil || !strings.Contains(err.Error(), "duplicate window") {
			t.Fatalf("Run: %v, want the stream's duplicate window refused", err)
		}
	})
}

func TestCleanupDeletesOldRowsOnly(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	insert := func(consumer string, age time.Duration, n int) {
		for range n {
			if _, err := e.db.Pool.Exec(ctx,
				`INSERT INTO processed_events (consumer_name, event_id, processed_at) VALUES ($1, $2, now() - $3 * interval '1 second')`,
				consumer, uuid.New(), age.Seconds()); err != nil {
				t.Fatal(err)
			}
		}
	}
	insert(testConsumer, 20*day, 5)
	insert(testConsumer, day, 3)
	insert("other", 20*day, 2)
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO inbox_sequences (consumer_name, source, aggregate_type, aggregate_id, last_seq, updated_at)
		VALUES ($1, 'orders', 'order', 'a', 7, now() - interval '30 days')`, testConsumer); err != nil {
		t.Fatal(err)
	}

	deleted, err := deleteProcessed(ctx, e.db.Pool, testConsumer, 14*day, 2) // three batches
	if err != nil {
		t.Fatal(err)
	}
	if deleted != 5 {
		t.Errorf("deleted %d rows, want 5", deleted)
	}
	if n := e.count(t, `SELECT count(*) FROM processed_events WHERE consumer_name = $1`, testConsumer); n != 3 {
		t.Errorf("%d recent rows left, want 3", n)
	}
	if n := e.count(t, `SELECT count(*) FROM processed_events WHERE consumer_name = 'other'`); n != 2 {
		t.Errorf("another consumer's rows: %d left, want 2", n)
	}
	if n := e.count(t, `SELECT count(*) FROM inbox_sequences`); n != 1 {
		t.Errorf("inbox_sequences rows: %d, want the cursor kept", n)
	}
}

func TestSurvivesBrokerRestart(t *testing.T) {
	t.Parallel()
	e := setup(t)
	run(t, e.consumer(t, e.pool, e.js, e.config(t, record(""))))

	e.publish(t, newEvent("a", 1))
	eventually(t, "a/1 is applied", func() bool { return len(e.seqs(t, "a")) == 1 })
	e.nats.Stop()
	e.nats.Start()
	e.publish(t, newEvent("a", 2))
	eventually(t, "a/2 is applied after the outage", func() bool { return len(e.seqs(t, "a")) == 2 && e.settled(t) })
	wantSeqs(t, e, "a", 1, 2)
}

func TestUnhandledTypesOnlyAdvanceTheCursor(t *testing.T) {
	t.Parallel()
	e := setup(t)
	shortDuplicateWindow(t, e)
	cfg := e.config(t, record(""))
	cfg.Handles = []string{"OrderCreated"}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)

	other := func(agg string, seq int64) event {
		ev := newEvent(agg, seq)
		ev.typ = "OrderAwaitingPayment"
		return ev
	}
	// a: handled, unhandled, handled. b: its unhandled event 2 arrives
	// before event 1 and must wait for it, as a handled one would.
	a2, b2 := other("a", 2), other("b", 2)
	e.publish(t, newEvent("a", 1), a2, newEvent("a", 3), b2)
	time.Sleep(100 * time.Millisecond) // b2 is offered and waits at its gap
	e.publish(t, newEvent("b", 1))
	eventually(t, "all messages are acked", func() bool { return e.settled(t) })

	wantSeqs(t, e, "a", 1, 3) // the handler never saw event 2
	wantSeqs(t, e, "b", 1)
	if n := e.count(t, `SELECT last_seq FROM inbox_sequences WHERE consumer_name = $1 AND aggregate_id = 'b'`, testConsumer); n != 2 {
		t.Errorf("cursor of b: %d, want 2", n)
	}
	// Recorded like any other event: verify and reconcile look for it.
	if n := e.count(t, `SELECT count(*) FROM processed_events WHERE consumer_name = $1 AND event_id = ANY($2)`,
		testConsumer, []uuid.UUID{a2.id, b2.id}); n != 2 {
		t.Errorf("processed_events has %d of the 2 unhandled events", n)
	}

	// A copy of an unhandled event is absorbed.
	e.republish(t, a2)
	eventually(t, "the copy is acked", func() bool { return e.settled(t) })
	eventually(t, "the copy is counted", func() bool { return c.Counters().Duplicates == 1 })
	if got := c.Counters(); got.Processed != 5 {
		t.Errorf("counters %+v, want 5 processed", got)
	}
}

// An unhandled event commits with its one record statement; dying before
// its ack leaves a copy that must be absorbed like any other.
func TestCrashAfterRecordingUnhandledEvent(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.Handles = []string{"OrderCreated"}
	cfg.AckWait = time.Second // the redelivery comes after AckWait
	cfg.BatchSize = 1         // the single-delivery path, where an unhandled event commits alone
	// The process dies once, right after a/2's commit: the only moment the
	// cursor of a stands at 2 when a commit is done (a's events are one
	// worker's, one at a time).
	var crashed atomic.Bool
	cfg.Hooks.FailpointFunc = func(name string) error {
		if name != "inbox.after_commit_before_ack" || crashed.Load() {
			return nil
		}
		var seq int64
		err := e.db.Pool.QueryRow(context.Background(),
			`SELECT last_seq FROM inbox_sequences WHERE consumer_name = $1 AND aggregate_id = 'a'`, testConsumer).Scan(&seq)
		if err == nil && seq == 2 && crashed.CompareAndSwap(false, true) {
			return errInjected
		}
		return nil
	}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)

	ev := newEvent("a", 2)
	ev.typ = "OrderAwaitingPayment"
	e.publish(t, newEvent("a", 1), ev, newEvent("a", 3))
	eventually(t, "the redelivered copy is acked", func() bool {
		return crashed.Load() && c.Counters().Duplicates >= 1 && e.settled(t)
	})

	wantSeqs(t, e, "a", 1, 3)
	// The crashed delivery counts nothing; its copy is the duplicate.
	if n := e.count(t, `SELECT last_seq FROM inbox_sequences WHERE consumer_name = $1 AND aggregate_id = 'a'`, testConsumer); n != 3 {
		t.Errorf("cursor of a: %d, want 3", n)
	}
	if got := c.Counters(); got != (Counters{Processed: 2, Duplicates: 1}) {
		t.Errorf("counters %+v, want 2 processed and the copy of the unhandled event as 1 duplicate", got)
	}
}

// When the database refuses the inbox's own record statement, before any
// handler ran, the event is retried without counting an attempt: with
// MaxDeliver 1 a counted failure would dead-letter it at once. Both paths
// take this statement: with a transaction (a handled type) and without
// (an unhandled one).
func TestDatabaseFailureBeforeTheHandlerIsNotAnAttempt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	if _, err := e.db.Pool.Exec(ctx, `CREATE TABLE refuse (on_ boolean NOT NULL); INSERT INTO refuse VALUES (true)`); err != nil {
		t.Fatal(err)
	}
	e.refuseProcessedEvents(t, "EXISTS (SELECT 1 FROM refuse WHERE on_)", "insufficient_resources", "the database refuses for now")
	cfg := e.config(t, record(""))
	cfg.Handles = []string{"OrderCreated"}
	cfg.MaxDeliver = 1
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)

	unhandled := newEvent("b", 1) // its own aggregate, so it is not held at a gap behind a
	unhandled.typ = "OrderAwaitingPayment"
	e.publish(t, newEvent("a", 1), unhandled)
	eventually(t, "both kinds of delivery are retried", func() bool { return c.Counters().Retries >= 4 })
	if _, err := e.db.Pool.Exec(ctx, `UPDATE refuse SET on_ = false`); err != nil {
		t.Fatal(err)
	}
	eventually(t, "all messages are acked", func() bool { return e.settled(t) })

	wantSeqs(t, e, "a", 1)
	wantSeqs(t, e, "b") // recorded, never handled
	if n := e.count(t, `SELECT count(*) FROM processed_events WHERE consumer_name = $1`, testConsumer); n != 2 {
		t.Errorf("processed_events: %d rows, want 2", n)
	}
	if n := e.count(t, `SELECT count(*) FROM dead_letters`) + e.count(t, `SELECT count(*) FROM inbox_failures`); n != 0 {
		t.Errorf("%d dead letters and failure records, want none: the handler never failed", n)
	}
}

// A failure of the inbox's own statements that is not the database being
// away is about the message: it counts towards MaxDeliver (a value the
// tables refuse, SQLSTATE class 22, is poison at once), and is never
// retried for ever.
func TestFailureBeforeTheHandlerThatIsNoOutageEnds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		errcode  string
		attempts int
	}{
		{"P0001", 2},                      // raise_exception: counted, dead after MaxDeliver
		{"numeric_value_out_of_range", 1}, // class 22: poison at once
	} {
		t.Run(tc.errcode, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			e.refuseProcessedEvents(t, "NEW.aggregate_id = 'bad'", tc.errcode, "this row cannot be")
			cfg := e.config(t, record(""))
			cfg.MaxDeliver = 2
			c := e.consumer(t, e.pool, e.js, cfg)
			run(t, c)

			e.publish(t, newEvent("bad", 1), newEvent("ok", 1))
			eventually(t, "all messages are settled", func() bool { return e.settled(t) })
			wantSeqs(t, e, "ok", 1)
			dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10)
			if err != nil {
				t.Fatal(err)
			}
			if len(dead) != 1 || dead[0].Attempts != tc.attempts || !strings.Contains(dead[0].Error, "this row cannot be") {
				t.Fatalf("dead letters %+v, want one after %d attempts", dead, tc.attempts)
			}
		})
	}
}

// refuseProcessedEvents makes every insert into processed_events for which
// the SQL condition when holds fail with SQLSTATE errcode (a condition
// name or code) and message: a failure of the inbox's own statements, as
// the database or the message may cause it.
func (e *env) refuseProcessedEvents(t *testing.T, when, errcode, message string) {
	t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), fmt.Sprintf(`
		CREATE FUNCTION refuse_processed() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF %s THEN
				RAISE EXCEPTION '%s' USING ERRCODE = '%s';
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON processed_events FOR EACH ROW EXECUTE FUNCTION refuse_processed();`,
		when, message, errcode)); err != nil {
		t.Fatal(err)
	}
}
