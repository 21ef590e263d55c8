package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/internal/testenv"
	"github.com/shop-ref/shop/pkg/outbox/migrations"
)

type env struct {
	db     *testenv.Schema
	nats   *testenv.Server
	js     jetstream.JetStream
	stream jetstream.Stream
}

func setup(t *testing.T) *env {
	t.Helper()
	t.Parallel()
	e := &env{db: newSchema(t), nats: testenv.NATS(t)}
	_, e.js = e.nats.Connect(t)
	e.stream = e.nats.Stream(t, e.js, "EV", "ev.>")
	return e
}

func event(agg, typ string) Event {
	return Event{
		AggregateType: "order", AggregateID: agg, Type: typ,
		Subject: "ev." + agg + "." + typ,
		Payload: map[string]string{"order_id": agg},
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
	}
}

// add commits events in one transaction.
func add(t testing.TB, pool *pgxpool.Pool, w *Writer, events ...Event) {
	t.Helper()
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		return w.Add(context.Background(), tx, events...)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func (e *env) relay(t testing.TB, cfg Config) *Relay {
	t.Helper()
	cfg.Logger = cmpLogger(cfg.Logger)
	r, err := NewRelay(e.db.Pool, e.js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func cmpLogger(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.New(slog.DiscardHandler)
}

// start runs r until the test ends.
func start(t testing.TB, r *Relay) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	})
}

// forEachMode runs f as a subtest per relay mode: every failure window of
// the outbox that does not depend on how the poller claims holds however
// the relay finds its events.
func forEachMode(t *testing.T, f func(t *testing.T, mode Mode)) {
	for _, m := range []Mode{ModePoll, ModeCDC} {
		t.Run(string(m), func(t *testing.T) { f(t, m) })
	}
}

// run starts a relay with cfg in mode until the test ends. In ModeCDC it
// waits until the relay streams its slot, so that the events the test
// writes next go through the stream, and a short HandOff lets the poller
// take what the stream leaves to the table within the test. In ModePoll
// it waits until the relay listens, so that the test's first commit
// wakes it.
func (e *env) run(t *testing.T, mode Mode, cfg Config) *Relay {
	t.Helper()
	cfg.Mode = mode
	if mode == ModeCDC && cfg.HandOff == 0 {
		cfg.HandOff = 300 * time.Millisecond
	}
	r := e.relay(t, cfg)
	start(t, r)
	if mode == ModeCDC {
		streaming(t, r)
	} else if !cfg.DisableListen {
		listening(t, e)
	}
	return r
}

// listening waits until a relay LISTENs on the schema's channel: a test
// whose poller only a NOTIFY wakes in time (a long PollInterval) must not
// commit before it listens, or the wake-up is lost (under load the LISTEN
// connection can come after the test's first commit).
func listening(t testing.TB, e *env) {
	t.Helper()
	listen := "LISTEN " + pgx.Identifier{"outbox." + e.db.Name}.Sanitize()
	eventually(t, 20*time.Second, "the relay listens", func() (bool, error) {
		var n int
		err := e.db.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE query = $1 AND state = 'idle'`, listen).Scan(&n)
		return n > 0, err
	})
}

// streaming waits until r streams its slot.
func streaming(t testing.TB, r *Relay) {
	t.Helper()
	eventually(t, 20*time.Second, "relay streams its slot", func() (bool, error) {
		return r.State().Streaming, nil
	})
}

// eventually waits for cond, failing the test after timeout.
func eventually(t testing.TB, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func count(t testing.TB, db DB, where string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), "SELECT count(*) FROM outbox WHERE "+where, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func streamMsgs(t testing.TB, st jetstream.Stream) uint64 {
	t.Helper()
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

func TestAdd(t *testing.T) {
	t.Run("commit leaves exactly one intent per event, numbered per aggregate", func(t *testing.T) {
		e := setup(t)
		var w Writer
		add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-2", "OrderCreated"))
		add(t, e.db.Pool, &w, event("o-1", "OrderPaid"), event("o-1", "OrderCompleted"))
		// Several aggregates, interleaved, go in one statement.
		add(t, e.db.Pool, &w, event("o-2", "A"), event("o-1", "B"), event("o-3", "C"), event("o-2", "D"))

		rows, err := e.db.Pool.Query(context.Background(),
			`SELECT aggregate_id, aggregate_seq, event_type FROM outbox ORDER BY aggregate_id, aggregate_seq`)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for rows.Next() {
			var agg, typ string
			var seq int64
			if err := rows.Scan(&agg, &seq, &typ); err != nil {
				t.Fatal(err)
			}
			got = append(got, fmt.Sprintf("%s/%d/%s", agg, seq, typ))
		}
		want := "o-1/1/OrderCreated o-1/2/OrderPaid o-1/3/OrderCompleted o-1/4/B o-2/1/OrderCreated o-2/2/A o-2/3/D o-3/1/C"
		if strings.Join(got, " ") != want {
			t.Fatalf("outbox = %v, want %s", got, want)
		}
	})

	t.Run("rollback leaves no intent and no gap", func(t *testing.T) {
		e := setup(t)
		var w Writer
		ctx := context.Background()
		tx, err := e.db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Add(ctx, tx, event("o-1", "OrderCreated")); err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if n := count(t, e.db.Pool, "true"); n != 0 {
			t.Fatalf("%d intents after rollback, want 0", n)
		}
		add(t, e.db.Pool, &w, event("o-1", "OrderCreated"))
		if n := count(t, e.db.Pool, "aggregate_seq = 1"); n != 1 {
			t.Fatal("the first committed event after a rollback is not seq 1")
		}
	})

	t.Run("invalid events are refused before anything is written", func(t *testing.T) {
		e := setup(t)
		var w Writer
		bad := event("o-1", "OrderCreated")
		bad.Payload = []byte("{not json")
		err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
			return w.Add(context.Background(), tx, event("o-1", "X"), bad)
		})
		if !errors.Is(err, ErrInvalidEvent) {
			t.Fatalf("err = %v, want ErrInvalidEvent", err)
		}
		if n := count(t, e.db.Pool, "true"); n != 0 {
			t.Fatalf("%d rows written for a refused batch", n)
		}
	})

	t.Run("the writer's prefix makes the subjects its events leave empty", func(t *testing.T) {
		e := setup(t)
		w := Writer{Prefix: "ev"}
		own := event("o-1", "OrderPaid")
		own.Subject = "ev.elsewhere.OrderPaid"
		made := event("o-1", "OrderCreated")
		made.Subject = ""
		add(t, e.db.Pool, &w, made, own)
		for typ, want := range map[string]string{"OrderCreated": "ev.o-1.OrderCreated", "OrderPaid": "ev.elsewhere.OrderPaid"} {
			if n := count(t, e.db.Pool, "event_type = $1 AND subject = $2", typ, want); n != 1 {
				t.Errorf("%s: no event on %s", typ, want)
			}
		}
	})

	t.Run("an event without a subject is refused when no prefix can make one, or it would not be one token", func(t *testing.T) {
		e := setup(t)
		noSubject := func(agg, typ string) Event { ev := event(agg, typ); ev.Subject = ""; return ev }
		for _, c := range []struct {
			name   string
			w      *Writer
			ev     Event
			reason string
		}{
			{"no prefix", &Writer{}, noSubject("o-1", "OrderCreated"), "no Prefix"},
			{"dotted aggregate id", &Writer{Prefix: "ev"}, noSubject("o.1", "OrderCreated"), "aggregate id"},
			{"wildcard in the type", &Writer{Prefix: "ev"}, noSubject("o-1", "Order*"), "event type"},
			{"dotted prefix", &Writer{Prefix: "ev.x"}, noSubject("o-1", "OrderCreated"), "writer prefix"},
		} {
			err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
				return c.w.Add(context.Background(), tx, c.ev)
			})
			if !errors.Is(err, ErrInvalidEvent) || !strings.Contains(err.Error(), c.reason) {
				t.Errorf("%s: err = %v, want ErrInvalidEvent naming %q", c.name, err, c.reason)
			}
		}
		if n := count(t, e.db.Pool, "true"); n != 0 {
			t.Fatalf("%d rows written for refused events", n)
		}
	})

	t.Run("sequences given by the caller are stored, and a reused one is refused", func(t *testing.T) {
		e := setup(t)
		var w Writer
		first, second := event("o-1", "OrderCreated"), event("o-1", "OrderAwaitingPayment")
		first.Seq, second.Seq = 1, 2
		add(t, e.db.Pool, &w, first, second)
		if n := count(t, e.db.Pool, "aggregate_id = 'o-1' AND aggregate_seq IN (1, 2)"); n != 2 {
			t.Fatalf("%d of 2 events stored with their given sequence", n)
		}
		again := event("o-1", "OrderPaid")
		again.Seq = 2
		err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
			return w.Add(context.Background(), tx, again)
		})
		if err == nil || count(t, e.db.Pool, "true") != 2 {
			t.Fatalf("a reused sequence was accepted (err %v)", err)
		}
		mixed := event("o-2", "B")
		mixed.Seq = 2
		err = pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
			return w.Add(context.Background(), tx, event("o-2", "A"), mixed)
		})
		if !errors.Is(err, ErrInvalidEvent) {
			t.Fatalf("mixing given and counted sequences: err = %v, want ErrInvalidEvent", err)
		}
	})

	t.Run("concurrent transactions on one aggregate get gap-free unique sequences", func(t *testing.T) {
		e := setup(t)
		w := Writer{NotifyInterval: time.Second}
		var wg sync.WaitGroup
		const writers, each = 8, 25
		var committed sync.Map
		for i := range writers {
			wg.Go(func() {
				for j := range each {
					ctx := context.Background()
					tx, err := e.db.Pool.Begin(ctx)
					if err != nil {
						t.Error(err)
						return
					}
					if err := w.Add(ctx, tx, event("hot", "Touched")); err != nil {
						t.Error(err)
						return
					}
					if (i+j)%3 == 0 { // every third one changes its mind
						_ = tx.Rollback(ctx)
						continue
					}
					if err := tx.Commit(ctx); err != nil {
						t.Error(err)
						return
					}
					committed.Store(fmt.Sprint(i, j), true)
				}
			})
		}
		wg.Wait()
		n := 0
		committed.Range(func(_, _ any) bool { n++; return true })
		var rows, maxSeq, distinct int
		err := e.db.Pool.QueryRow(context.Background(),
			`SELECT count(*), max(aggregate_seq), count(DISTINCT aggregate_seq) FROM outbox`).Scan(&rows, &maxSeq, &distinct)
		if err != nil {
			t.Fatal(err)
		}
		if rows != n || maxSeq != n || distinct != n {
			t.Fatalf("committed %d: rows %d, max seq %d, distinct %d", n, rows, maxSeq, distinct)
		}
	})
}

func TestRelayPublishesWithContractHeaders(t *testing.T) {
	forEachMode(t, testRelayPublishesWithContractHeaders)
}

func testRelayPublishesWithContractHeaders(t *testing.T, mode Mode) {
	e := setup(t)
	e.run(t, mode, Config{PollInterval: time.Hour}) // only NOTIFY, or the stream, can wake it in time
	var w Writer
	ev := event("o-1", "OrderCreated")
	ev.ID = uuid.Must(uuid.NewV7())
	ev.SchemaVersion = 2
	add(t, e.db.Pool, &w, ev)

	eventually(t, 10*time.Second, "event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 1, nil
	})
	msg, err := e.stream.GetLastMsgForSubject(context.Background(), "ev.o-1.OrderCreated")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"Nats-Msg-Id": ev.ID.String(), "Event-Type": "OrderCreated", "Aggregate-Id": "o-1",
		"Aggregate-Seq": "1", "Schema-Version": "2", "traceparent": ev.Headers["traceparent"],
	}
	for k, v := range want {
		if got := msg.Header.Get(k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
	if _, err := time.Parse(time.RFC3339, msg.Header.Get("Occurred-At")); err != nil {
		t.Errorf("Occurred-At: %v", err)
	}
	if string(msg.Data) != `{"order_id":"o-1"}` {
		t.Errorf("payload = %s", msg.Data)
	}
}

func TestRelayCrashAfterClaim(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-2", "OrderCreated"))

	crashed := e.relay(t, Config{Name: "crashed", LeaseDuration: 300 * time.Millisecond, PublishTimeout: 100 * time.Millisecond})
	claimed, err := crashed.claim(context.Background(), uuid.New())
	if err != nil || len(claimed) != 2 {
		t.Fatalf("claim: %d rows, %v", len(claimed), err)
	}
	// The relay dies here. Its lease is committed, so nobody else takes the
	// rows until it expires; then the survivor does.
	survivor := e.relay(t, Config{Name: "survivor", PollInterval: 50 * time.Millisecond})
	start(t, survivor)
	eventually(t, 10*time.Second, "survivor publishes after the lease expires", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 2, nil
	})
	if got := streamMsgs(t, e.stream); got != 2 {
		t.Fatalf("stream holds %d messages, want 2", got)
	}
}

// A relay that dies holding claims frees them when it stops saying it is
// alive (alive.go), not a lease later: with a ten-minute lease, the events
// a dead relay claimed go out within seconds. The claims of a relay that
// is alive are left alone, whatever the lease.
func TestDeadRelaysClaimsAreTakenOverBeforeTheirLease(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	var w Writer
	add(t, e.db.Pool, &w, event("dead-1", "OrderCreated"), event("dead-2", "OrderCreated"))
	long := Config{LeaseDuration: 10 * time.Minute, PollInterval: 50 * time.Millisecond}

	dead := e.rowRelay(t, withName(long, "dead"))
	if _, err := e.db.Pool.Exec(ctx, heartbeatSQL, dead.cfg.Name, aliveFor.Microseconds(), "", time.Now()); err != nil {
		t.Fatal(err) // it said it was alive, once
	}
	if claimed, err := dead.claim(ctx, uuid.New()); err != nil || len(claimed) != 2 {
		t.Fatalf("claim: %d rows, %v", len(claimed), err)
	}
	// A live relay holds claims too, and keeps saying it is alive.
	add(t, e.db.Pool, &w, event("live-1", "OrderCreated"))
	live := e.rowRelay(t, withName(long, "live"))
	liveCtx, stopLive := context.WithCancel(ctx)
	defer stopLive()
	go live.stayAlive(liveCtx)
	if claimed, err := live.claim(ctx, uuid.New()); err != nil || len(claimed) != 1 {
		t.Fatalf("live claim: %d rows, %v", len(claimed), err)
	}

	survivor := e.rowRelay(t, withName(long, "survivor"))
	start(t, survivor)
	eventually(t, 30*time.Second, "the dead relay's events published, its lease not over", func() (bool, error) {
		return count(t, e.db.Pool, "aggregate_id LIKE 'dead-%' AND published_at IS NOT NULL") == 2, nil
	})
	if got := survivor.Counters().TakenOver; got != 2 {
		t.Errorf("the survivor took over %d claims, want 2", got)
	}
	if n := count(t, e.db.Pool, "aggregate_id = 'live-1' AND published_at IS NULL AND claimed_by = 'live'"); n != 1 {
		t.Fatal("the live relay's claim was taken")
	}
	// A clean stop says it is gone: the relay's row is deleted.
	stopLive()
	eventually(t, 10*time.Second, "the live relay's row gone", func() (bool, error) {
		var n int
		err := e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_relays WHERE name = 'live'`).Scan(&n)
		return n == 0, err
	})
}

func withName(c Config, name string) Config { c.Name = name; return c }

// rowRelay is a relay with per-row claims, whichever mode the suite runs in.
func (e *env) rowRelay(t testing.TB, cfg Config) *Relay {
	t.Helper()
	cfg.Logger = cmpLogger(cfg.Logger)
	r, err := NewRelay(e.db.Pool, e.js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// A polling relay dies between the broker's ack and its mark; the
// survivor publishes the event again under its id (a copy the stream
// drops) once the lease expires. In ModeCDC the survivor streams (a
// service switched from poll to cdc after a crash): the event predates its
// slot, so its poller publishes it from the table. The stream's own crash
// in this window is TestFailpointAfterAckBeforeMark/cdc and
// TestCDCCrashBetweenPubAckAndConfirm.
func TestRelayCrashAfterAckBeforeMark(t *testing.T) { forEachMode(t, testRelayCrashAfterAckBeforeMark) }

func testRelayCrashAfterAckBeforeMark(t *testing.T, mode Mode) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"))

	crashed := e.relay(t, Config{Name: "crashed", LeaseDuration: 300 * time.Millisecond, PublishTimeout: 100 * time.Millisecond})
	batch, err := crashed.claim(context.Background(), uuid.New())
	if err != nil {
		t.Fatal(err)
	}
	results, err := crashed.publish(context.Background(), batch)
	if err != nil {
		t.Fatal(err)
	}
	for _, res := range results {
		if res.err != nil {
			t.Fatal(res.err)
		}
	}
	// Acked by the broker, never marked: the relay died in between.
	survivor := e.run(t, mode, Config{Name: "survivor", PollInterval: 50 * time.Millisecond})
	eventually(t, 10*time.Second, "event marked by the survivor", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 1, nil
	})
	if got := survivor.Counters(); got.Duplicates != 1 || got.TakenOver != 1 {
		t.Fatalf("survivor counted %d duplicate acks and %d expired leases taken over, want 1 and 1", got.Duplicates, got.TakenOver)
	}
	if got := streamMsgs(t, e.stream); got != 1 {
		t.Fatalf("stream holds %d messages; the duplicate window should have dropped the copy", got)
	}
}

func TestStaleRelayIsFencedOff(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"))
	ctx := context.Background()

	stale := e.relay(t, Config{Name: "stale", LeaseDuration: 200 * time.Millisecond, PublishTimeout: 50 * time.Millisecond})
	staleToken := uuid.New()
	batch, err := stale.claim(ctx, staleToken)
	if err != nil || len(batch) != 1 {
		t.Fatalf("claim: %v %d", err, len(batch))
	}
	time.Sleep(250 * time.Millisecond) // the stale relay pauses past its lease (a GC pause, a hung host)

	fresh := e.relay(t, Config{Name: "fresh"})
	freshToken := uuid.New()
	if again, err := fresh.claim(ctx, freshToken); err != nil || len(again) != 1 {
		t.Fatalf("fresh relay could not take over the expired lease: %v %d", err, len(again))
	}

	// The stale relay wakes and tries to mark and to fail the row.
	if _, err := stale.settle(ctx, staleToken, batch, []result{{}}); err != nil {
		t.Fatal(err)
	}
	if _, err := stale.settle(ctx, staleToken, batch, []result{{err: errors.New("boom"), permanent: true}}); err != nil {
		t.Fatal(err)
	}
	rec, err := Get(ctx, e.db.Pool, batch[0].id)
	if err != nil {
		t.Fatal(err)
	}
	if rec.PublishedAt != nil || rec.DeadAt != nil || rec.Attempts != 0 || rec.ClaimedBy == nil || *rec.ClaimedBy != "fresh" {
		t.Fatalf("stale relay changed a row it no longer owns: %+v", rec)
	}
	if got := stale.Counters().LostLeases; got != 2 {
		t.Fatalf("stale relay counted %d lost leases, want 2", got)
	}
	if _, err := fresh.settle(ctx, freshToken, batch, []result{{}}); err != nil {
		t.Fatal(err)
	}
	if n := count(t, e.db.Pool, "published_at IS NOT NULL"); n != 1 {
		t.Fatal("the owner could not mark its row")
	}
}

func TestBrokerOutage(t *testing.T) { forEachMode(t, testBrokerOutage) }

func testBrokerOutage(t *testing.T, mode Mode) {
	e := setup(t)
	e.run(t, mode, Config{PollInterval: 50 * time.Millisecond})
	e.nats.Stop()

	var w Writer
	for i := range 200 {
		add(t, e.db.Pool, &w, event(fmt.Sprintf("o-%d", i%20), "Step"))
	}
	time.Sleep(300 * time.Millisecond) // the relay tries during the outage
	stats, err := ReadStats(context.Background(), e.db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Pending != 200 || stats.OldestPending <= 0 {
		t.Fatalf("during the outage: %+v, want 200 pending with an age", stats)
	}

	e.nats.Start()
	eventually(t, 30*time.Second, "backlog drained after the broker returns", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 200, nil
	})
	if got := streamMsgs(t, e.stream); got != 200 {
		t.Fatalf("stream holds %d messages, want 200", got)
	}
	if n := count(t, e.db.Pool, "dead_at IS NOT NULL"); n != 0 {
		t.Fatalf("%d events died of a broker outage", n)
	}
}

// smallStream makes the stream SMALL on small.>, which refuses messages
// over 512 bytes: an event too large for it fails on its own, for good.
func (e *env) smallStream(t *testing.T) jetstream.Stream {
	t.Helper()
	small, err := e.js.CreateOrUpdateStream(context.Background(), jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 512})
	if err != nil {
		t.Fatal(err)
	}
	return small
}

func TestFailingHeadBlocksOnlyItsAggregate(t *testing.T) {
	forEachMode(t, testFailingHeadBlocksOnlyItsAggregate)
}

// In ModeCDC the stream makes the head dead, and leaves o-1's second event
// to the table: the poller publishes it once the head is requeued and
// published.
func testFailingHeadBlocksOnlyItsAggregate(t *testing.T, mode Mode) {
	e := setup(t)
	ctx := context.Background()
	small := e.smallStream(t)
	e.run(t, mode, Config{PollInterval: 50 * time.Millisecond})
	var w Writer
	broken := event("o-1", "OrderCreated")
	broken.Subject = "small.o-1.OrderCreated" // too large for its stream: a deterministic error
	broken.Payload = map[string]string{"blob": strings.Repeat("x", 2048)}
	add(t, e.db.Pool, &w, broken)
	add(t, e.db.Pool, &w, event("o-1", "OrderPaid"))
	add(t, e.db.Pool, &w, event("o-2", "OrderCreated"), event("o-2", "OrderPaid"))

	eventually(t, 10*time.Second, "o-1 head dead and o-2 published", func() (bool, error) {
		return count(t, e.db.Pool, "aggregate_id = 'o-1' AND aggregate_seq = 1 AND dead_at IS NOT NULL") == 1 &&
			count(t, e.db.Pool, "aggregate_id = 'o-2' AND published_at IS NOT NULL") == 2, nil
	})
	time.Sleep(200 * time.Millisecond) // a few more relay rounds
	if n := count(t, e.db.Pool, "aggregate_id = 'o-1' AND aggregate_seq = 2 AND published_at IS NULL"); n != 1 {
		t.Fatal("o-1 seq 2 was published before its dead seq 1")
	}
	dead, err := ListDead(ctx, e.db.Pool, 10)
	if err != nil || len(dead) != 1 || dead[0].LastError == nil || dead[0].Subject != broken.Subject {
		t.Fatalf("dead list: %d events (%v), want o-1's head", len(dead), err)
	}
	t.Logf("o-1's head died of: %s", *dead[0].LastError)

	// The operator raises the stream's limit and requeues: the aggregate
	// continues, in order.
	cfg := small.CachedInfo().Config
	cfg.MaxMsgSize = 1 << 20
	if _, err := e.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if err := Requeue(ctx, e.db.Pool, dead[0].EventID); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "o-1 published after requeue", func() (bool, error) {
		return count(t, e.db.Pool, "aggregate_id = 'o-1' AND published_at IS NOT NULL") == 2, nil
	})
	first, _ := Get(ctx, e.db.Pool, dead[0].EventID)
	var secondAt time.Time
	if err := e.db.Pool.QueryRow(ctx,
		`SELECT published_at FROM outbox WHERE aggregate_id = 'o-1' AND aggregate_seq = 2`).Scan(&secondAt); err != nil {
		t.Fatal(err)
	}
	if first.PublishedAt == nil || secondAt.Before(*first.PublishedAt) {
		t.Fatalf("o-1 seq 2 published at %v, before seq 1 at %v", secondAt, first.PublishedAt)
	}
}

// A stream the relay publishes to that the broker lost (a cluster that
// came back with empty stores, an operator's delete) is the broker's
// condition, not the events': they wait, no attempt counted, and go out in
// order once the stream is back. Once, the relay marked every event it
// claimed meanwhile dead ("no stream for subject"), and each needed a
// hand-run requeue.
func TestMissingStreamIsWaitedOut(t *testing.T) { forEachMode(t, testMissingStreamIsWaitedOut) }

// In ModeCDC the stream leaves the event of the missing stream to the
// table, uncounted (it cannot hold the slot's position for everyone), and
// pauses when its own stream is missing.
func testMissingStreamIsWaitedOut(t *testing.T, mode Mode) {
	e := setup(t)
	ctx := context.Background()
	var w Writer
	r := e.run(t, mode, Config{PollInterval: 20 * time.Millisecond, BackoffBase: time.Millisecond, OutageBackoffMax: 20 * time.Millisecond})

	// Beside a stream that works: only the missing one's events wait.
	lost := event("o-1", "OrderCreated")
	lost.Subject = "nostream.o-1.OrderCreated"
	add(t, e.db.Pool, &w, lost)
	add(t, e.db.Pool, &w, event("o-2", "OrderCreated"))
	eventually(t, 10*time.Second, "o-2 published, o-1 handed back", func() (bool, error) {
		return count(t, e.db.Pool, "aggregate_id = 'o-2' AND published_at IS NOT NULL") == 1 && r.Counters().Deferred >= 3, nil
	})
	if n := count(t, e.db.Pool, "aggregate_id = 'o-1' AND dead_at IS NULL AND attempts = 0 AND published_at IS NULL"); n != 1 {
		t.Fatalf("the event of the missing stream: %d rows waiting, alive and uncounted; want 1", n)
	}

	// The relay's own stream lost: everything it has waits, and it reports
	// the broker as taking nothing.
	if err := e.js.DeleteStream(ctx, "EV"); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		add(t, e.db.Pool, &w, event(fmt.Sprintf("o-%d", 3+i%4), "During"))
	}
	eventually(t, 10*time.Second, "the relay to report the outage", func() (bool, error) {
		return !r.State().UnavailableSince.IsZero(), nil
	})
	time.Sleep(300 * time.Millisecond) // many relay rounds
	if n := count(t, e.db.Pool, "dead_at IS NOT NULL OR attempts > 0"); n != 0 {
		t.Fatalf("%d events dead or counted while their stream was missing", n)
	}

	// The owners create the streams again: every event goes out, in order.
	e.stream = e.nats.Stream(t, e.js, "EV", "ev.>")
	e.nats.Stream(t, e.js, "NOSTREAM", "nostream.>")
	eventually(t, 10*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	if n := count(t, e.db.Pool, "dead_at IS NOT NULL OR attempts > 0"); n != 0 {
		t.Fatalf("%d events dead or counted", n)
	}
	if got := streamMsgs(t, e.stream); got != 20 {
		t.Fatalf("the recreated stream holds %d messages, want the 20 written while it was missing", got)
	}
	eventually(t, 10*time.Second, "the relay reports the broker back", func() (bool, error) {
		return r.State().UnavailableSince.IsZero(), nil
	})
}

func TestDeterministicErrorsMakeEventsDead(t *testing.T) {
	forEachMode(t, testDeterministicErrorsMakeEventsDead)
}

func testDeterministicErrorsMakeEventsDead(t *testing.T, mode Mode) {
	e := setup(t)
	e.smallStream(t)
	var w Writer
	big := event("o-1", "Big")
	big.Subject = "small.o-1.Big"
	big.Payload = map[string]string{"blob": strings.Repeat("x", 2048)}
	badHeader := event("o-2", "BadHeader")
	badHeader.Headers = map[string]string{"traceparent": "a\r\nInjected: yes"}
	// In ModeCDC the stream alone may record them (the poller would take
	// them an hour later): it once failed to, its statement refused, and
	// ended its stream over and over until the poller did.
	r := e.run(t, mode, Config{PollInterval: 50 * time.Millisecond, HandOff: time.Hour})
	add(t, e.db.Pool, &w, big, badHeader)

	eventually(t, 10*time.Second, "both events dead", func() (bool, error) {
		return count(t, e.db.Pool, "dead_at IS NOT NULL") == 2, nil
	})
	if n := count(t, e.db.Pool, "attempts = 1"); n != 2 {
		t.Fatalf("%d of 2 dead events died on their first attempt", n)
	}
	if c := r.Counters(); c.Dead != 2 {
		t.Fatalf("counters %+v, want 2 dead", c)
	}
}

// An event the broker refuses for a reason retrying may cure is tried
// again after a backoff that doubles, and is dead after MaxAttempts. The
// broker refuses it for real: the event asks, in a header of its own, for
// a stream that is not the one its subject goes to. In ModeCDC the stream
// records the first failure and leaves the event to the table, where the
// poller makes the later attempts.
func TestTransientFailuresBackOffThenDie(t *testing.T) {
	forEachMode(t, testTransientFailuresBackOffThenDie)
}

func testTransientFailuresBackOffThenDie(t *testing.T, mode Mode) {
	e := setup(t)
	ctx := context.Background()
	r := e.relay(t, Config{Mode: mode, HandOff: 300 * time.Millisecond, PollInterval: 20 * time.Millisecond,
		MaxAttempts: 3, BackoffBase: time.Hour, BackoffMax: 10 * time.Hour, OutageBackoffMax: time.Hour})
	// Every backoff its longest, so that "not claimable yet" does not
	// depend on a draw: full jitter may pick a microsecond, gone before the
	// next claim looks (a test once failed on that).
	r.jitter = longestJitter
	start(t, r)
	if mode == ModeCDC {
		streaming(t, r)
	}
	var w Writer
	refused := event("o-1", "OrderCreated")
	refused.Headers = map[string]string{"Nats-Expected-Stream": "NOT-EV"}
	add(t, e.db.Pool, &w, refused)

	for attempt := 1; attempt <= 3; attempt++ {
		if attempt > 1 {
			// Skip the wait of the previous backoff, and the HandOff.
			if _, err := e.db.Pool.Exec(ctx, `UPDATE outbox SET available_at = now() - interval '1 hour'`); err != nil {
				t.Fatal(err)
			}
		}
		eventually(t, 10*time.Second, fmt.Sprintf("attempt %d", attempt), func() (bool, error) {
			return count(t, e.db.Pool, "attempts = $1", attempt) == 1, nil
		})
		rows, err := e.db.Pool.Query(ctx, `SELECT `+recordColumns+` FROM outbox`)
		if err != nil {
			t.Fatal(err)
		}
		rec, err := pgx.CollectExactlyOneRow(rows, scanRecord)
		if err != nil {
			t.Fatal(err)
		}
		if rec.LastError == nil || !strings.Contains(*rec.LastError, "expected stream does not match") {
			t.Fatalf("attempt %d recorded as %+v", attempt, rec)
		}
		if dead := rec.DeadAt != nil; dead != (attempt == 3) {
			t.Fatalf("attempt %d: dead = %v", attempt, dead)
		}
		if attempt < 3 {
			// base·2^(attempt-1) from the failure, less a minute for a slow machine.
			floor := fmt.Sprintf("now() + interval '%d minutes'", 60<<(attempt-1)-1)
			if n := count(t, e.db.Pool, "available_at > "+floor); n != 1 {
				t.Fatalf("attempt %d: not backed off by its base (%s)", attempt, floor)
			}
			if again, _ := r.claim(ctx, uuid.New()); len(again) != 0 {
				t.Fatalf("attempt %d: claimable again before its backoff ended", attempt)
			}
		}
	}
	if c := r.Counters(); c.Retried != 2 || c.Dead != 1 || c.Published != 0 {
		t.Fatalf("counters %+v, want 2 retried, 1 dead, none published", c)
	}
	if n := streamMsgs(t, e.stream); n != 0 {
		t.Fatalf("stream holds %d messages of a refused event", n)
	}
	if mode == ModeCDC && !r.State().Streaming {
		t.Fatal("an event's own failure ended the stream") // it would wait an hour's backoff to start again
	}
}

// longestJitter draws the longest delay backoff allows.
func longestJitter(n int64) int64 { return n - 1 }

func TestBackoffIsCappedFullJitter(t *testing.T) {
	for attempt := 1; attempt < 80; attempt++ {
		ceiling := min(time.Second, 10*time.Millisecond<<(min(attempt, 31)-1))
		for range 20 {
			d := backoff(10*time.Millisecond, time.Second, attempt, rand.Int64N)
			if d <= 0 || d > ceiling {
				t.Fatalf("attempt %d: backoff %v outside (0, %v]", attempt, d, ceiling)
			}
		}
	}
}

// Retention's statement alone, whatever the mode; the relay that runs it,
// in both: TestRelayRetentionDeletesOnlyWhatItPublished.
func TestRetentionDeletesOnlyOldPublishedEvents(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("old-published", "A"), event("new-published", "A"),
		event("old-pending", "A"), event("old-dead", "A"))
	ctx := context.Background()
	_, err := e.db.Pool.Exec(ctx, `
		UPDATE outbox SET published_at = CASE aggregate_id
			WHEN 'old-published' THEN now() - interval '10 days'
			WHEN 'new-published' THEN now() END,
		    dead_at = CASE WHEN aggregate_id = 'old-dead' THEN now() - interval '10 days' END,
		    occurred_at = now() - interval '10 days'`)
	if err != nil {
		t.Fatal(err)
	}
	n, err := deleteExpired(ctx, e.db.Pool, 72*time.Hour, 1, nil)
	if err != nil || n != 1 {
		t.Fatalf("deleted %d, %v; want 1", n, err)
	}
	if count(t, e.db.Pool, "aggregate_id = 'old-published'") != 0 || count(t, e.db.Pool, "true") != 3 {
		t.Fatal("retention deleted the wrong rows")
	}
	// Sequence counters survive, so the next event continues the numbering.
	add(t, e.db.Pool, &w, event("old-published", "B"))
	if count(t, e.db.Pool, "aggregate_id = 'old-published' AND aggregate_seq = 2") != 1 {
		t.Fatal("sequence restarted after retention")
	}
}

// A running relay's retention deletes the events it published once they
// are older than Retention, and never one that waits (dead, or behind a
// dead one); numbering goes on after it. In ModeCDC the stream neither
// sees the deletes (its publication takes inserts) nor minds a deleted
// previous event (gone from the table is published).
func TestRelayRetentionDeletesOnlyWhatItPublished(t *testing.T) {
	forEachMode(t, testRelayRetentionDeletesOnlyWhatItPublished)
}

func testRelayRetentionDeletesOnlyWhatItPublished(t *testing.T, mode Mode) {
	e := setup(t)
	e.smallStream(t)
	e.run(t, mode, Config{PollInterval: 50 * time.Millisecond, Retention: time.Millisecond, RetentionInterval: 20 * time.Millisecond})
	var w Writer
	broken := event("o-1", "Big")
	broken.Subject = "small.o-1.Big" // too large for its stream: dead at once
	broken.Payload = map[string]string{"blob": strings.Repeat("x", 2048)}
	add(t, e.db.Pool, &w, broken)
	add(t, e.db.Pool, &w, event("o-1", "After"))
	add(t, e.db.Pool, &w, event("o-2", "A"), event("o-2", "B"))
	add(t, e.db.Pool, &w, event("o-3", "A"))
	eventually(t, 10*time.Second, "published events deleted, waiting ones kept", func() (bool, error) {
		return streamMsgs(t, e.stream) == 3 && count(t, e.db.Pool, "true") == 2 &&
			count(t, e.db.Pool, "aggregate_id = 'o-1' AND (dead_at IS NOT NULL OR aggregate_seq = 2)") == 2, nil
	})
	add(t, e.db.Pool, &w, event("o-2", "C"))
	eventually(t, 10*time.Second, "the next event published and deleted", func() (bool, error) {
		return streamMsgs(t, e.stream) == 4 && count(t, e.db.Pool, "true") == 2, nil
	})
	inOrder(t, seqsBySubject(t, e.stream), map[string]int{"o-2": 3, "o-3": 1})
}

func TestConfigValidation(t *testing.T) {
	_, err := NewRelay(nil, nil, Config{LeaseDuration: time.Second, PublishTimeout: 900 * time.Millisecond})
	if err == nil || !strings.Contains(err.Error(), "PublishTimeout") {
		t.Fatalf("err = %v, want a PublishTimeout/LeaseDuration complaint", err)
	}
	// Every attempt that counts may wait out a lease, a publish timeout
	// and a full backoff: 10 × (15s + 3s + 30s) with the defaults.
	if h := (Config{}).RetryHorizon(); h != 8*time.Minute {
		t.Fatalf("default retry horizon %v, want 8m0s", h)
	}
}

func TestDisableListenPollsWithoutListening(t *testing.T) {
	e := setup(t)
	r := e.relay(t, Config{DisableListen: true, PollInterval: 50 * time.Millisecond})
	start(t, r)
	var w Writer // notifies on every commit; nobody listens
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"))
	eventually(t, 10*time.Second, "event published by polling", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 1, nil
	})
	var listeners int
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE query = $1`,
		"LISTEN "+pgx.Identifier{"outbox." + e.db.Name}.Sanitize()).Scan(&listeners); err != nil {
		t.Fatal(err)
	}
	if listeners != 0 {
		t.Errorf("%d LISTEN connections with DisableListen", listeners)
	}
}

// RepublishAll is the repair for messages the broker lost: the copies keep
// their ids and go out in sequence order. While the stream still remembers
// an id (its duplicate window) the copy is dropped as a duplicate; a broker
// that lost messages in a crash rebuilds that memory from what it stored,
// which a restart after deleting them shows.
func TestRepublishAllSendsLostEventsAgainInOrder(t *testing.T) {
	forEachMode(t, testRepublishAllSendsLostEventsAgainInOrder)
}

// In ModeCDC the republished rows are updates, which the slot does not
// carry: the poller publishes them after the HandOff.
func testRepublishAllSendsLostEventsAgainInOrder(t *testing.T, mode Mode) {
	e := setup(t)
	var w Writer
	r := e.run(t, mode, Config{PollInterval: 20 * time.Millisecond})
	add(t, e.db.Pool, &w, event("o-1", "A"), event("o-1", "B"), event("o-1", "C"))
	eventually(t, 10*time.Second, "events published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 3, nil
	})
	ctx := context.Background()
	rows, err := e.db.Pool.Query(ctx, `SELECT event_id FROM outbox ORDER BY aggregate_seq`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		t.Fatal(err)
	}
	// The broker loses A and B (stream sequences 1 and 2).
	for seq := uint64(1); seq <= 2; seq++ {
		if err := e.stream.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	marked, err := RepublishAll(ctx, e.db.Pool, []uuid.UUID{ids[1], ids[0], uuid.Must(uuid.NewV7())})
	if err != nil || len(marked) != 2 {
		t.Fatalf("RepublishAll marked %v, %v; want the two published events only", marked, err)
	}
	eventually(t, 10*time.Second, "copies dropped as duplicates", func() (bool, error) {
		return r.Counters().Duplicates == 2 && count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	if n := streamMsgs(t, e.stream); n != 1 {
		t.Fatalf("stream holds %d messages, want 1: inside the duplicate window the copies are dropped", n)
	}

	e.nats.Stop() // what a crash that lost A and B leaves behind
	e.nats.Start()
	if marked, err := RepublishAll(ctx, e.db.Pool, ids[:2]); err != nil || len(marked) != 2 {
		t.Fatalf("RepublishAll after the restart marked %v, %v", marked, err)
	}
	eventually(t, 20*time.Second, "copies stored", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0 && streamMsgs(t, e.stream) == 3, nil
	})
	for i, seq := range []uint64{4, 5} { // after C (3): A, then B
		m, err := e.stream.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.Header.Get("Nats-Msg-Id"); got != ids[i].String() {
			t.Errorf("stream seq %d is %s, want %s (%s)", seq, got, ids[i], []string{"A", "B"}[i])
		}
	}
}

// newSchema is a test's own schema holding the outbox's tables, from this
// package's migrations/ alone.
func newSchema(t testing.TB) *testenv.Schema {
	t.Helper()
	return testenv.New(t, testenv.Migrations{Table: "outbox_goose_version", FS: migrations.FS()})
}
