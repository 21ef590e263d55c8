package flowtest

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgcluster"
	"github.com/shop-ref/shop/proof/poll"
)

// The tests in this file break the Postgres server itself (restart it,
// invalidate a replication slot with a cluster-wide setting), so each has
// a private cluster (proof/pgcluster), never the shared test server.

// privateSchema migrates the eventing tables into schema on c and opens a
// pool on it, closed when the test ends.
func privateSchema(t *testing.T, c *pgcluster.Cluster, schema string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := migrations.Apply(ctx, c.URL(), schema, nil, nil); err != nil {
		t.Fatalf("migrate %s: %v", schema, err)
	}
	pool, err := database.NewPool(ctx, c.URL(), schema, maxConns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// streamIDs reads every message of a stream and returns, per event id,
// how many messages carry it, and the aggregate sequences of each
// aggregate in stream order.
func streamIDs(t *testing.T, js jetstream.JetStream, stream string) (map[string]int, map[string][]int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ids, seqs := map[string]int{}, map[string][]int64{}
	for got := uint64(0); got < info.State.Msgs; {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			h := m.Headers()
			ids[h.Get("Nats-Msg-Id")]++
			seq, _ := strconv.ParseInt(h.Get("Aggregate-Seq"), 10, 64)
			seqs[h.Get("Aggregate-Id")] = append(seqs[h.Get("Aggregate-Id")], seq)
		}
		if batch.Error() != nil {
			t.Fatal(batch.Error())
		}
		if n == 0 {
			t.Fatalf("read %d of the stream's %d messages, then nothing", got, info.State.Msgs)
		}
		got += uint64(n)
	}
	return ids, seqs
}

// outboxIDs returns the event ids of every row of the outbox.
func outboxIDs(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT event_id::text FROM outbox`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// requireAllInStream fails unless every event of the outbox is in the
// stream, once.
func requireAllInStream(t *testing.T, pool *pgxpool.Pool, js jetstream.JetStream, stream string) map[string][]int64 {
	t.Helper()
	inStream, seqs := streamIDs(t, js, stream)
	ids := outboxIDs(t, pool)
	missing, twice := 0, 0
	for _, id := range ids {
		switch inStream[id] {
		case 0:
			missing++
		case 1:
		default:
			twice++
		}
	}
	if missing > 0 || twice > 0 || len(inStream) != len(ids) {
		t.Errorf("of %d outbox events, %d are missing from the stream and %d are in it more than once; it holds %d ids",
			len(ids), missing, twice, len(inStream))
	}
	return seqs
}

// writeUntil commits one event per transaction, round the aggregates,
// until stop is closed, retrying each commit through a database outage
// as a service would. A commit whose result was lost with the server may
// have happened: its retry is another event, and the outbox, not the
// writer, says which events were committed.
func writeUntil(ctx context.Context, pool *pgxpool.Pool, writer, aggregates int, stop <-chan struct{}, retries *atomic.Int64) {
	var w outbox.Writer
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		agg := fmt.Sprintf("a-%02d", (writer+i)%aggregates)
		for {
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return w.Add(ctx, tx, outbox.Event{
					AggregateType: "order", AggregateID: agg, Type: "Step",
					Subject: "ev." + agg + ".Step", Payload: map[string]int{"writer": writer, "i": i},
				})
			})
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return
			}
			retries.Add(1)
			select {
			case <-ctx.Done():
				return
			case <-time.After(20 * time.Millisecond): // a client's retry pause, not a wait for a condition
			}
		}
	}
}

// TestPostgresRestartMidStream: a ModeCDC relay streams a busy outbox
// into an inbox consumer while Postgres restarts under it, once with -m
// fast (the slot's position written at the shutdown checkpoint) and once
// with -m immediate (a crash: the slot comes back at its last checkpoint's
// position, so events already published and confirmed are streamed and
// published again under the same ids). Writers keep committing through
// both outages. At the end every committed event is in the stream once,
// applied once, and each aggregate's in order.
func TestPostgresRestartMidStream(t *testing.T) {
	t.Parallel()
	const aggregates, writers, step = 12, 3, 300
	pg := pgcluster.Start(t, nil)
	producer := privateSchema(t, pg, "producer", 6)
	consumerPool := privateSchema(t, pg, "consumer", 12)
	if _, err := consumerPool.Exec(context.Background(), `CREATE TABLE effects (
		applied    bigint GENERATED ALWAYS AS IDENTITY,
		aggregate  text   NOT NULL,
		seq        bigint NOT NULL,
		event_id   uuid   NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	srv.Stream(t, js, "EV", "ev.>")

	relay, err := outbox.NewRelay(producer, js, outbox.Config{
		Mode: outbox.ModeCDC, PollInterval: 100 * time.Millisecond, HandOff: time.Second,
		BackoffBase: 20 * time.Millisecond, OutageBackoffMax: 500 * time.Millisecond, Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "relay", relay.Run)
	c, err := inbox.NewConsumer(consumerPool, js, inbox.Config{
		Name: "effects", Stream: "EV", Handler: inbox.Each(recordEffect), Workers: 4,
		BackoffBase: 20 * time.Millisecond, BackoffMax: 500 * time.Millisecond, Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "consumer", c.Run)
	poll.Until(t, 30*time.Second, "the relay streams its slot", func() bool { return relay.State().Streaming })

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var retries atomic.Int64
	for wr := range writers {
		wg.Go(func() { writeUntil(ctx, producer, wr, aggregates, stop, &retries) })
	}
	stopWriters := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopWriters()

	// Each restart comes once the consumer has applied step more events
	// than before it: mid-stream, with the writers busy.
	applied := func(n int64) {
		t.Helper()
		poll.Until(t, time.Minute, fmt.Sprintf("%d events applied, the relay streaming", n), func() bool {
			return c.Counters().Processed >= n && relay.State().Streaming
		})
	}
	applied(step)
	for i, mode := range []pgcluster.Mode{pgcluster.Fast, pgcluster.Immediate} {
		before, dups := c.Counters().Processed, relay.Counters().Duplicates
		if err := pg.Restart(ctx, mode); err != nil {
			t.Fatalf("restart -m %s: %v", mode, err)
		}
		applied(before + step)
		// Not asserted: how much is streamed again depends on when the
		// server last saved the slot (a checkpoint, or the slot's restart
		// position moving).
		t.Logf("restart %d (-m %s) after %d events applied; %d published again (duplicate acks) in the %d events after it",
			i+1, mode, before, relay.Counters().Duplicates-dups, step)
	}
	stopWriters()

	poll.Until(t, 2*time.Minute, "every committed event published", func() bool {
		st, err := outbox.ReadStats(ctx, producer)
		return err == nil && st.Pending == 0 && st.Dead == 0
	})
	// Published, and nothing left for the consumer to settle: no copy can
	// land later, so the counts below are final.
	poll.Until(t, time.Minute, "the consumer to settle every message", func() bool {
		lag, err := c.Lag(ctx)
		return err == nil && lag == 0
	})
	total := scalar(t, producer, `SELECT count(*) FROM outbox`)
	checkEffects(t, consumerPool, total)
	requireAllInStream(t, producer, js, "EV")
	if got := c.Counters(); got.DeadLetters != 0 {
		t.Errorf("consumer counters %+v: dead letters", got)
	}
	rc, st := relay.Counters(), relay.State()
	t.Logf("%d events over %d aggregates; writers retried %d commits; relay: %d marked published, %d duplicate acks, %d handed off; consumer: %+v",
		total, aggregates, retries.Load(), rc.Published, rc.Duplicates, st.HandedOff, c.Counters())
}

// records keeps the messages a relay logs at a level or above.
type records struct {
	mu    sync.Mutex
	level slog.Level
	msgs  []string
}

func (r *records) Enabled(_ context.Context, l slog.Level) bool { return l >= r.level }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, rec.Level.String()+" "+rec.Message)
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

func (r *records) has(prefix string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range r.msgs {
		if strings.HasPrefix(m, prefix) {
			return true
		}
	}
	return false
}

// TestSlotInvalidatedByMaxSlotWALKeepSize: a ModeCDC relay is stopped,
// events are committed meanwhile, and so much other WAL is written that
// Postgres invalidates the relay's slot (max_slot_wal_keep_size): its
// position and the WAL of those events are gone. The relay started again
// says so, makes the slot anew, and the events the old slot had not
// confirmed go out from the outbox table; none is lost, none published
// twice, each aggregate in order.
//
// max_slot_wal_keep_size is counted in whole WAL segments, rounded down:
// 1MB with 16MB segments keeps no segment past the current one, so the
// first checkpoint after a segment switch invalidates a slot left behind.
func TestSlotInvalidatedByMaxSlotWALKeepSize(t *testing.T) {
	t.Parallel()
	const aggregates, perPhase = 4, 20
	pg := pgcluster.Start(t, map[string]string{"max_slot_wal_keep_size": "1MB"})
	ctx := context.Background()
	pool := privateSchema(t, pg, "producer", 6)
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	srv.Stream(t, js, "EV", "ev.>")

	var w outbox.Writer
	write := func(phase string) {
		t.Helper()
		for i := range perPhase {
			agg := fmt.Sprintf("a-%d", i%aggregates)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return w.Add(ctx, tx, outbox.Event{
					AggregateType: "order", AggregateID: agg, Type: "Step",
					Subject: "ev." + agg + ".Step", Payload: map[string]string{"phase": phase},
				})
			})
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	published := func(what string) {
		t.Helper()
		poll.Until(t, time.Minute, what, func() bool {
			st, err := outbox.ReadStats(ctx, pool)
			return err == nil && st.Pending == 0 && st.Dead == 0
		})
	}
	slot := func() outbox.SlotStats {
		t.Helper()
		st, err := outbox.ReadSlot(ctx, pool, "")
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	cfg := outbox.Config{Mode: outbox.ModeCDC, PollInterval: 100 * time.Millisecond, HandOff: 500 * time.Millisecond}

	// A relay streams the first events, then stops.
	first, err := outbox.NewRelay(pool, js, func() outbox.Config { c := cfg; c.Logger = quiet; return c }())
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stopFirst := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- first.Run(runCtx) }()
	poll.Until(t, 30*time.Second, "the first relay streams", func() bool { return first.State().Streaming })
	write("before")
	published("the first events published")
	stopFirst()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "the slot left by the stopped relay", func() bool {
		st := slot()
		return st.Exists && !st.Active
	})

	// Events committed while no relay runs; then other tables' WAL, and
	// checkpoints, until Postgres gives up the slot.
	write("while stopped")
	if _, err := pool.Exec(ctx, `CREATE TABLE filler (b text)`); err != nil {
		t.Fatal(err)
	}
	for i := 0; slot().WALStatus != "lost"; i++ {
		if i == 20 {
			t.Fatalf("slot still %+v after %d segment switches and checkpoints", slot(), i)
		}
		_, err := pool.Exec(ctx, `INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 2000);
			SELECT pg_switch_wal(); CHECKPOINT`)
		if err != nil {
			t.Fatal(err)
		}
	}
	if st := slot(); st.WALStatus != "lost" || st.Active {
		t.Fatalf("before the restart: slot %+v, want wal_status lost", st)
	}

	// A relay starts again: it says the slot was lost, makes it anew and
	// publishes from the table what the old slot had not confirmed.
	logs := &records{level: slog.LevelWarn}
	second, err := outbox.NewRelay(pool, js, func() outbox.Config { c := cfg; c.Logger = slog.New(logs); return c }())
	if err != nil {
		t.Fatal(err)
	}
	run(t, "relay", second.Run)
	poll.Until(t, 30*time.Second, "the second relay streams", func() bool { return second.State().Streaming })
	if !logs.has("ERROR outbox relay: the slot was invalidated") {
		t.Errorf("the relay did not log the invalidation at ERROR; it logged %q", logs.msgs)
	}
	write("after")
	published("every event published")
	requireAllInStream(t, pool, js, "EV")
	_, seqs := streamIDs(t, js, "EV")
	for agg, s := range seqs {
		for i := range s {
			if s[i] != int64(i+1) {
				t.Errorf("aggregate %s in the stream in the order %v", agg, s)
				break
			}
		}
	}
	if n := scalar(t, pool, `SELECT count(*) FROM outbox`); n != 3*perPhase {
		t.Errorf("%d events in the outbox, want %d", n, 3*perPhase)
	}
	if st := slot(); !st.Exists || st.WALStatus != "reserved" {
		t.Errorf("after: slot %+v, want wal_status reserved", st)
	}
	t.Logf("relay after the loss: %d published, %d handed off to the table", second.Counters().Published, second.State().HandedOff)
}

// TestCDCOutOfSendersOrSlotsPollsAtOnce: the server has no room for the
// relay's stream. Every WAL sender is taken (max_wal_senders=1, held by
// another replication client), so Postgres refuses the relay's
// replication connection (SQLSTATE 53300); or every replication slot is
// taken (max_replication_slots=1, another slot), so it refuses to make the
// relay's (53400). The first was retried quietly as a passing error while
// the relay said "standby" and every event waited the HandOff. The relay
// must say why in one ERROR naming the setting and its value, say it in
// its State (which /readyz and the metrics show), and poll at once: with
// an hour's HandOff only polling publishes within the test. When the
// server has room again the relay streams, and what it streams goes out
// too.
func TestCDCOutOfSendersOrSlotsPollsAtOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, setting string
		// take fills the server's last place; it returns what frees it.
		take func(t *testing.T, pg *pgcluster.Cluster, pool *pgxpool.Pool) (release func())
	}{
		{"WAL senders", "max_wal_senders", func(t *testing.T, pg *pgcluster.Cluster, _ *pgxpool.Pool) func() {
			cc, err := pgconn.ParseConfig(pg.URL())
			if err != nil {
				t.Fatal(err)
			}
			cc.RuntimeParams["replication"] = "database"
			holder, err := pgconn.ConnectConfig(context.Background(), cc)
			if err != nil {
				t.Fatal(err)
			}
			return func() { _ = holder.Close(context.Background()) }
		}},
		{"replication slots", "max_replication_slots", func(t *testing.T, _ *pgcluster.Cluster, pool *pgxpool.Pool) func() {
			if _, err := pool.Exec(context.Background(), `SELECT pg_create_logical_replication_slot('another', 'pgoutput')`); err != nil {
				t.Fatal(err)
			}
			return func() {
				if _, err := pool.Exec(context.Background(), `SELECT pg_drop_replication_slot('another')`); err != nil {
					t.Error(err)
				}
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			testOutOfRoomPollsAtOnce(t, tc.setting, tc.take)
		})
	}
}

func testOutOfRoomPollsAtOnce(t *testing.T, setting string, take func(*testing.T, *pgcluster.Cluster, *pgxpool.Pool) func()) {
	const aggregates, perPhase = 4, 20
	pg := pgcluster.Start(t, map[string]string{setting: "1"})
	ctx := context.Background()
	pool := privateSchema(t, pg, "producer", 6)
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	srv.Stream(t, js, "EV", "ev.>")
	release := sync.OnceFunc(take(t, pg, pool))
	t.Cleanup(release)

	var w outbox.Writer
	write := func(phase string) {
		t.Helper()
		for i := range perPhase {
			agg := fmt.Sprintf("a-%d", i%aggregates)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return w.Add(ctx, tx, outbox.Event{
					AggregateType: "order", AggregateID: agg, Type: "Step",
					Subject: "ev." + agg + ".Step", Payload: map[string]string{"phase": phase},
				})
			})
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	published := func(what string) {
		t.Helper()
		poll.Until(t, time.Minute, what, func() bool {
			st, err := outbox.ReadStats(ctx, pool)
			return err == nil && st.Pending == 0 && st.Dead == 0
		})
	}

	logs := &records{level: slog.LevelError}
	relay, err := outbox.NewRelay(pool, js, outbox.Config{Mode: outbox.ModeCDC, HandOff: time.Hour,
		PollInterval: 100 * time.Millisecond, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "relay", relay.Run)
	poll.Until(t, 30*time.Second, "the relay says why it cannot stream", func() bool { return relay.State().CDCUnavailable != "" })
	if why := relay.State().CDCUnavailable; !strings.Contains(why, setting+"=1") {
		t.Errorf("CDCUnavailable = %q, want it to name the setting and its value, %s=1", why, setting)
	}
	write("no room")
	published("the events published by polling, at once")

	release()
	poll.Until(t, time.Minute, "the relay streams once the server has room", func() bool {
		st := relay.State()
		return st.Streaming && st.CDCUnavailable == ""
	})
	write("streaming")
	published("the events published by the stream")
	requireAllInStream(t, pool, js, "EV")
	_, seqs := streamIDs(t, js, "EV")
	for agg, s := range seqs {
		for i := range s {
			if s[i] != int64(i+1) {
				t.Errorf("aggregate %s in the stream in the order %v", agg, s)
				break
			}
		}
	}
	logs.mu.Lock()
	defer logs.mu.Unlock()
	if n := len(logs.msgs); n != 1 || !strings.HasPrefix(logs.msgs[0], "ERROR outbox relay: cannot stream the outbox by CDC") {
		t.Errorf("the relay logged %q at ERROR, want the one line that says why it cannot stream", logs.msgs)
	}
	t.Logf("relay: %d published, %d duplicate acks", relay.Counters().Published, relay.Counters().Duplicates)
}
