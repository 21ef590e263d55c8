package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// The failure windows of ModeCDC alone. The windows both modes share run
// in both (forEachMode); the Postgres restart and the slot invalidated by
// max_slot_wal_keep_size need a server of their own (proof/flowtest).

// seqsBySubject reads the stream and returns each aggregate's
// Aggregate-Seq values in stream order.
func seqsBySubject(t testing.TB, st jetstream.Stream) map[string][]int64 {
	t.Helper()
	ctx := context.Background()
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]int64{}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.ParseInt(m.Header.Get("Aggregate-Seq"), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		agg := m.Header.Get("Aggregate-Id")
		out[agg] = append(out[agg], n)
	}
	return out
}

// inOrder fails unless every aggregate's sequence in the stream is 1..n,
// each once, ascending.
func inOrder(t testing.TB, bySubject map[string][]int64, want map[string]int) {
	t.Helper()
	for agg, n := range want {
		got := bySubject[agg]
		if len(got) != n {
			t.Errorf("aggregate %s: %d messages in the stream, want %d", agg, len(got), n)
			continue
		}
		for i, s := range got {
			if s != int64(i+1) {
				t.Errorf("aggregate %s: message %d carries Aggregate-Seq %d (stream order %v)", agg, i, s, got)
				break
			}
		}
	}
}

// The stream crashes twice between a PubAck and the slot's confirmation:
// once after the acks before the mark ("outbox.after_ack_before_mark"),
// once after the mark before the confirmed position reaches the server
// ("outbox.cdc_after_mark"). Each time the next stream starts from the
// confirmed position and publishes the unconfirmed tail again, same ids:
// the stream holds each event once (Nats-Msg-Id), in order, every row ends
// published, and the relay counted the copies as duplicates.
func TestCDCCrashBetweenPubAckAndConfirm(t *testing.T) {
	e := setup(t)
	beforeMark, afterMark := failOn("outbox.after_ack_before_mark", 1), failOn("outbox.cdc_after_mark", 1)
	cfg := fastLease(nil)
	// The stream alone publishes here: the crashes are the stream's. Its
	// restarts can outlast run's short HandOff under -race on a busy
	// machine; the poller then takes the tail too, publishes it again and
	// counts its marks a second time (Published 35-45, not 30).
	cfg.HandOff = time.Minute
	cfg.Hooks.FailpointFunc = func(name string) error {
		if err := beforeMark.hook(name); err != nil {
			return err
		}
		return afterMark.hook(name)
	}
	r := e.run(t, ModeCDC, cfg)
	var w Writer
	want := map[string]int{}
	for tx := range 6 { // several transactions, five aggregates in each
		var evs []Event
		for i := range 5 {
			agg := fmt.Sprintf("o-%d", (tx+i)%5)
			evs = append(evs, event(agg, "Step"))
			want[agg]++
		}
		add(t, e.db.Pool, &w, evs...)
	}
	eventually(t, 20*time.Second, "every event published, past both crashes", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0 && beforeMark.n.Load() >= 2 && afterMark.n.Load() >= 2, nil
	})
	if got := streamMsgs(t, e.stream); got != 30 {
		t.Fatalf("stream holds %d messages, want 30: each event once, the copies dropped by id", got)
	}
	inOrder(t, seqsBySubject(t, e.stream), want)
	if c := r.Counters(); c.Duplicates == 0 || c.Published != 30 {
		t.Fatalf("counters %+v: want 30 published, and the copies the restarts sent counted as duplicates", c)
	}
}

// Eight writers commit to one aggregate at once while the relay streams.
// The writer numbers an aggregate's events under its counter row's lock,
// so event k+1's transaction commits after k's; the slot sends
// transactions in commit order; the relay sends k+1 only after k's ack.
// The stream must hold 1..400 in order.
func TestCDCConcurrentWritersOnOneAggregate(t *testing.T) {
	e := setup(t)
	r := e.run(t, ModeCDC, Config{})
	pool := e.db.NewPool(t, 8)
	var w Writer
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				add(t, pool, &w, event("hot", "Step"))
			}
		}()
	}
	wg.Wait()
	eventually(t, 30*time.Second, "400 events published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 400, nil
	})
	inOrder(t, seqsBySubject(t, e.stream), map[string]int{"hot": 400})
	if n := r.State().HandedOff; n != 0 {
		t.Fatalf("the stream left %d events to the table: the order above is not the stream's alone", n)
	}
}

// The slot dropped while the relay streams and writers write (an operator,
// or a slot invalidated): the relay makes it again, and what was committed
// while no slot existed goes out from the table, each aggregate in order.
func TestCDCSlotDroppedMidStream(t *testing.T) {
	dropMidStream(t, func(ctx context.Context, e *env, slot string) error {
		return DropSlot(ctx, e.db.Pool, slot)
	})
}

// The publication dropped while the relay streams (shop slots drop racing
// the relay that makes the slot again, or an operator by hand): the slot
// cannot decode past the database's next change without it, so the relay
// makes the publication and then the slot again, and the same holds.
func TestCDCPublicationDroppedMidStream(t *testing.T) {
	dropMidStream(t, func(ctx context.Context, e *env, slot string) error {
		_, err := e.db.Pool.Exec(ctx, `DROP PUBLICATION `+pgx.Identifier{slot}.Sanitize())
		return err
	})
}

// dropMidStream runs a relay in ModeCDC, drops (drop) what its stream
// needs between writers' commits, and checks that the relay streams a
// slot with its publication again and that every event went out, each
// aggregate in order. The HandOff is an hour: what no stream carried goes
// out by the backfill of the relay that makes the slot again, at once.
func dropMidStream(t *testing.T, drop func(ctx context.Context, e *env, slot string) error) {
	e := setup(t)
	r := e.run(t, ModeCDC, Config{PollInterval: 50 * time.Millisecond, HandOff: time.Hour})
	ctx := context.Background()
	var w Writer
	want := map[string]int{}
	write := func(n int) {
		for i := range n {
			agg := fmt.Sprintf("o-%d", i%7)
			add(t, e.db.Pool, &w, event(agg, "Step"))
			want[agg]++
		}
	}
	published := func() (bool, error) { return count(t, e.db.Pool, "published_at IS NULL") == 0, nil }
	write(30)
	slot := r.State().Slot
	if err := drop(ctx, e, slot); err != nil {
		t.Fatal(err)
	}
	write(30) // some before the new slot, some after
	eventually(t, 30*time.Second, "the slot made again, with its publication, and streamed", func() (bool, error) {
		st, err := ReadSlot(ctx, e.db.Pool, slot)
		return st.Exists && st.Publication && r.State().Streaming, err
	})
	eventually(t, 30*time.Second, "every event before it published", published)
	write(30)
	eventually(t, 30*time.Second, "the events after it streamed", published)
	inOrder(t, seqsBySubject(t, e.stream), want)
}

// The publication dropped while the outbox is idle: the relay finds it
// missing without an event to fail on (its heartbeat is a change), makes
// it and the slot again (shop slots list shows the slot streamed, with
// its publication), and says so in one WARN, as docs/operating.md tells.
func TestCDCPublicationDroppedWhileIdle(t *testing.T) {
	e := setup(t)
	warns := &warnings{}
	r := e.run(t, ModeCDC, Config{HandOff: time.Hour, Logger: slog.New(warns)})
	ctx := context.Background()
	slot := r.State().Slot
	if _, err := e.db.Pool.Exec(ctx, `DROP PUBLICATION `+pgx.Identifier{slot}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the publication made again, and the slot streamed", func() (bool, error) {
		st, err := ReadSlot(ctx, e.db.Pool, slot)
		return st.Exists && st.Publication && st.Active && r.State().Streaming, err
	})
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"))
	eventually(t, 20*time.Second, "an event streamed", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	if got := warns.with("outbox relay: the slot cannot stream the outbox"); got == 0 {
		t.Errorf("no WARN says the slot cannot stream the outbox; the WARNs: %q", warns.all())
	}
}

// warnings is a slog.Handler that keeps the messages of WARN records.
type warnings struct {
	mu   sync.Mutex
	msgs []string
}

func (w *warnings) Enabled(context.Context, slog.Level) bool { return true }
func (w *warnings) WithAttrs([]slog.Attr) slog.Handler       { return w }
func (w *warnings) WithGroup(string) slog.Handler            { return w }

func (w *warnings) Handle(_ context.Context, r slog.Record) error {
	if r.Level == slog.LevelWarn {
		w.mu.Lock()
		w.msgs = append(w.msgs, r.Message)
		w.mu.Unlock()
	}
	return nil
}

func (w *warnings) all() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.msgs)
}

// with counts the WARNs whose message starts with prefix.
func (w *warnings) with(prefix string) int {
	n := 0
	for _, m := range w.all() {
		if strings.HasPrefix(m, prefix) {
			n++
		}
	}
	return n
}

// The publication dropped and made again while no relay streams, an
// event committed in between (one transaction here, so that no other
// test's sweep of orphan slots sees the slot without it): the publication
// exists when the relay starts, yet pgoutput fails on that event however
// often the stream starts again. The relay makes the slot again after the
// publication, and the event goes out from the table at once, not after
// the HandOff (an hour here).
func TestCDCSlotOlderThanItsPublication(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	slot := SlotName(e.dbName(t), e.db.Name)
	pub := pgx.Identifier{slot}.Sanitize()
	create := `CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert')`
	if _, err := e.db.Pool.Exec(ctx, create); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = DropSlot(context.Background(), e.db.Pool, slot) })
	var w Writer
	err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DROP PUBLICATION `+pub); err != nil {
			return err
		}
		if err := w.Add(ctx, tx, event("o-1", "OrderCreated")); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, create)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	r := e.relay(t, Config{Mode: ModeCDC, HandOff: time.Hour})
	start(t, r)
	eventually(t, 30*time.Second, "the event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	streaming(t, r)
	add(t, e.db.Pool, &w, event("o-1", "OrderPaid"))
	eventually(t, 20*time.Second, "the next event streamed", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	inOrder(t, seqsBySubject(t, e.stream), map[string]int{"o-1": 2})
}

// An outbox that writes nothing must not pin the WAL other schemas write:
// the idle relay confirms the server's position.
func TestCDCIdleOutboxDoesNotPinWAL(t *testing.T) {
	e := setup(t)
	e.run(t, ModeCDC, Config{})
	ctx := context.Background()
	other := newSchema(t) // another service's schema, busy
	if _, err := other.Pool.Exec(ctx, `CREATE TABLE busy (id bigserial PRIMARY KEY, pad text)`); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Pool.Exec(ctx, `INSERT INTO busy (pad) SELECT repeat('x', 500) FROM generate_series(1, 60000)`); err != nil {
		t.Fatal(err) // about 40 MB of WAL
	}
	var written int64
	if err := other.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn() - '0/0'::pg_lsn`).Scan(&written); err != nil {
		t.Fatal(err)
	}
	var last SlotStats
	eventually(t, 30*time.Second, "the slot to follow the WAL", func() (bool, error) {
		var err error
		last, err = ReadSlot(ctx, e.db.Pool, "")
		return err == nil && last.Exists && last.LagBytes < 1<<20, err
	})
	if !last.Active || last.WALStatus != "reserved" || last.LagAge > 10*time.Second {
		t.Fatalf("slot = %+v, want active, reserved, caught up lately", last)
	}
}

// Three relays of one service race for its slot: one streams, the others
// stand by; when it stops, another takes the slot, and nothing committed
// meanwhile is lost or reordered.
func TestCDCRelaysRaceForTheSlot(t *testing.T) {
	e := setup(t)
	type running struct {
		r      *Relay
		cancel context.CancelFunc
		done   chan error
	}
	var relays []running
	for i := range 3 {
		r := e.relay(t, Config{Name: fmt.Sprint("race-", i), Mode: ModeCDC, PollInterval: 100 * time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		relays = append(relays, running{r, cancel, done})
	}
	t.Cleanup(func() {
		for _, x := range relays {
			x.cancel()
			<-x.done
		}
	})
	streamer := func() (int, error) {
		n, who := 0, -1
		for i, x := range relays {
			if x.r.State().Streaming {
				n, who = n+1, i
			}
		}
		if n > 1 {
			return -1, fmt.Errorf("%d relays stream one slot", n)
		}
		return who, nil
	}
	var active int
	eventually(t, 20*time.Second, "one relay streams", func() (bool, error) {
		var err error
		active, err = streamer()
		return active >= 0, err
	})
	var w Writer
	want := map[string]int{}
	write := func(n int) {
		for i := range n {
			agg := fmt.Sprintf("o-%d", i%5)
			add(t, e.db.Pool, &w, event(agg, "Step"))
			want[agg]++
		}
	}
	write(20)
	relays[active].cancel()
	if err := <-relays[active].done; err != nil {
		t.Fatal(err)
	}
	relays[active].done <- nil // for the cleanup
	write(20)
	eventually(t, 20*time.Second, "another relay streams", func() (bool, error) {
		next, err := streamer()
		return next >= 0 && next != active, err
	})
	write(20)
	eventually(t, 20*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	inOrder(t, seqsBySubject(t, e.stream), want)
}

// A relay whose role cannot make the publication (it does not own the
// outbox table) cannot stream: it says why and polls.
func TestCDCUnavailableFallsBackToPolling(t *testing.T) {
	e := setup(t)
	r, err := NewRelay(e.roleWithoutReplication(t), e.js, Config{Mode: ModeCDC, PollInterval: 50 * time.Millisecond, Logger: cmpLogger(nil)})
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	eventually(t, 20*time.Second, "the relay to say why it cannot stream", func() (bool, error) {
		return r.State().CDCUnavailable != "", nil
	})
	// Both privileges CREATE PUBLICATION needs: the operator must learn
	// both from the one line, not find the second by trying again.
	if why := r.State().CDCUnavailable; !strings.Contains(why, "publication") || !strings.Contains(why, "CREATE on the database") || !strings.Contains(why, "ownership of the table") {
		t.Errorf("CDCUnavailable = %q, want it to name what is missing: the publication, CREATE on the database and ownership of the table", why)
	}
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-1", "OrderPaid"))
	eventually(t, 10*time.Second, "events published by polling", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 2, nil
	})
	if r.State().Streaming {
		t.Fatal("the relay says it streams")
	}
}

// The publication is there (its owner made it, as an operator might), but
// the relay's role may not replicate: Postgres refuses the replication
// connection itself. The relay must say so and poll, not retry the
// connection quietly and leave every event to wait the HandOff (an hour
// here, so that only polling as in ModePoll publishes within the test).
func TestCDCRoleThatMayNotReplicateFallsBackToPolling(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	slot := SlotName(e.dbName(t), e.db.Name)
	if _, err := e.db.Pool.Exec(ctx, `CREATE PUBLICATION `+pgx.Identifier{slot}.Sanitize()+
		` FOR TABLE outbox WITH (publish = 'insert')`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = DropSlot(context.Background(), e.db.Pool, slot) })
	r, err := NewRelay(e.roleWithoutReplication(t), e.js, Config{Mode: ModeCDC, HandOff: time.Hour,
		PollInterval: 50 * time.Millisecond, Logger: cmpLogger(nil)})
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	eventually(t, 20*time.Second, "the relay to say why it cannot stream", func() (bool, error) {
		return r.State().CDCUnavailable != "", nil
	})
	if why := r.State().CDCUnavailable; !strings.Contains(why, "REPLICATION") {
		t.Errorf("CDCUnavailable = %q, want it to name the privilege", why)
	}
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-1", "OrderPaid"), event("o-2", "OrderCreated"))
	eventually(t, 10*time.Second, "events published by polling", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 3, nil
	})
	inOrder(t, seqsBySubject(t, e.stream), map[string]int{"o-1": 2, "o-2": 1})
	if st, err := ReadSlot(ctx, e.db.Pool, slot); err != nil || st.Exists || r.State().Streaming {
		t.Fatalf("slot %+v (%v), streaming %v: want none made, none streamed", st, err, r.State().Streaming)
	}
}

func (e *env) dbName(t testing.TB) string {
	t.Helper()
	var name string
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

// roleWithoutReplication makes a throwaway login role that may neither
// replicate nor own the outbox (it may read and write the test schema's
// tables, as a service's role does), and returns a pool of its own on the
// schema. The role goes when the test ends.
func (e *env) roleWithoutReplication(t testing.TB) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	var b [4]byte
	_, _ = rand.Read(b[:])
	role := "t_norepl_" + hex.EncodeToString(b[:])
	schema := pgx.Identifier{e.db.Name}.Sanitize()
	for _, stmt := range []string{
		`CREATE ROLE ` + role + ` LOGIN NOREPLICATION`,
		`GRANT USAGE ON SCHEMA ` + schema + ` TO ` + role,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA ` + schema + ` TO ` + role,
	} {
		if _, err := e.db.Pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = e.db.Pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = e.db.Pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	u, err := url.Parse(e.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	q := u.Query()
	q.Set("pool_max_conns", "4")
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close) // before the role is dropped
	return pool
}

func TestUnknownModeIsRefused(t *testing.T) {
	if _, err := NewRelay(nil, nil, Config{Mode: "log"}); err == nil || !strings.Contains(err.Error(), "Mode") {
		t.Fatalf("err = %v, want the Mode refused", err)
	}
}

// Events committed before the slot existed (a first start, a lost slot)
// are in no stream: the relay that made the slot publishes them from the
// table at once, not after its HandOff (an hour here), and the stream
// holds back their aggregates' later events until they are out.
func TestCDCEventsBeforeTheSlotArePublishedAtOnce(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-2", "OrderCreated"))
	r := e.run(t, ModeCDC, Config{HandOff: time.Hour})
	add(t, e.db.Pool, &w, event("o-1", "OrderPaid"), event("o-3", "OrderCreated"))
	eventually(t, 20*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	inOrder(t, seqsBySubject(t, e.stream), map[string]int{"o-1": 2, "o-2": 1, "o-3": 1})
	if !r.State().Streaming {
		t.Fatal("the relay does not stream")
	}
}

// What the stream publishes, the stream marks. Postgres sends a commit to
// the walsender before the transaction is visible to other snapshots, so
// a relay that publishes within a millisecond can run its mark while the
// row is still invisible: the mark changed no row, the position was
// confirmed anyway, and the poller published the event a second time after
// the HandOff. A fault-free run of thousands of events: each is stored in
// the stream once, none is acked as a duplicate, and each is marked by the
// stream (long before the HandOff could give it to the poller).
func TestCDCMarksEveryEventItPublishes(t *testing.T) {
	e := setup(t)
	const handOff = 10 * time.Second
	r := e.run(t, ModeCDC, Config{HandOff: handOff})
	const writers, perWriter, aggregates = 4, 1000, 200
	pool := e.db.NewPool(t, writers)
	var w Writer
	var wg sync.WaitGroup
	for g := range writers {
		wg.Go(func() {
			for i := range perWriter {
				// One or two events per transaction, as the services write.
				evs := []Event{event(fmt.Sprintf("o-%d", (g*perWriter+i)%aggregates), "Step")}
				if i%3 == 0 {
					evs = append(evs, event(fmt.Sprintf("o-%d", (g*perWriter+i+1)%aggregates), "Step"))
				}
				add(t, pool, &w, evs...)
			}
		})
	}
	wg.Wait()
	total := count(t, e.db.Pool, "true")
	eventually(t, 2*handOff+30*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})

	// When the broker stored each event, against when its row was marked.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if got := streamMsgs(t, e.stream); got != uint64(total) {
		t.Fatalf("stream holds %d messages, want %d: each event once", got, total)
	}
	cons, err := e.stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	it, err := cons.Messages()
	if err != nil {
		t.Fatal(err)
	}
	defer it.Stop()
	stored := map[string]time.Time{}
	for range total {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			t.Fatal(err)
		}
		md, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		stored[m.Headers().Get(jetstream.MsgIDHeader)] = md.Timestamp
	}
	rows, err := e.db.Pool.Query(ctx, `SELECT event_id::text, published_at FROM outbox`)
	if err != nil {
		t.Fatal(err)
	}
	marks, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
		ID        string
		Published time.Time
	}])
	if err != nil {
		t.Fatal(err)
	}
	var lags []time.Duration
	overSecond, byPoller := 0, 0
	for _, m := range marks {
		at, ok := stored[m.ID]
		if !ok {
			t.Fatalf("event %s is not in the stream", m.ID)
		}
		lag := m.Published.Sub(at)
		lags = append(lags, lag)
		if lag > time.Second {
			overSecond++
		}
		if lag > handOff/2 {
			byPoller++ // only the poller marks so late: after the HandOff
		}
	}
	slices.Sort(lags)
	c := r.Counters()
	t.Logf("%d events: stored → marked p50 %v, p99 %v, max %v; %d marked over 1s after the broker stored them, %d by the poller; "+
		"%d duplicate acks; %d marks waited for their rows to become visible",
		total, lags[len(lags)/2], lags[len(lags)*99/100], lags[len(lags)-1], overSecond, byPoller, c.Duplicates, r.cdc.markWaits.Load())
	if byPoller > 0 || c.Duplicates > 0 {
		t.Errorf("%d events marked by the poller, %d published twice (duplicate acks): want 0 and 0, every event marked by the stream that published it",
			byPoller, c.Duplicates)
	}
	if n := r.State().HandedOff; n != 0 {
		t.Errorf("the stream left %d events to the table, want 0 in a fault-free run", n)
	}
}

// The replication connection breaks under the relay (the network, a
// server gone): pgconn reads an error, not a message, and closes the
// connection in a goroutine of its own, writing its Terminate. The relay
// wrote its last standby status update on the same connection then: a
// data race (-race, once in TestPostgresRestartMidStream). Cut three
// times mid-stream: the stream starts again each time, every event goes
// out once and in order, and -race finds nothing.
func TestCDCReplicationConnectionCutMidStream(t *testing.T) {
	e := setup(t)
	proxy := newCutter(t, e.db.URL)
	r, err := NewRelay(proxy.pool(t, e.db.URL), e.js, Config{Mode: ModeCDC, HandOff: time.Minute,
		PollInterval: 50 * time.Millisecond, BackoffBase: 10 * time.Millisecond, OutageBackoffMax: 200 * time.Millisecond,
		Logger: cmpLogger(nil)})
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	streaming(t, r)
	walsender := func() (pid int) {
		err := e.db.Pool.QueryRow(context.Background(), `SELECT coalesce(active_pid, 0) FROM pg_replication_slots WHERE slot_name = $1`,
			r.State().Slot).Scan(&pid)
		if err != nil {
			t.Fatal(err)
		}
		return pid
	}
	var w Writer
	want := map[string]int{}
	write := func(n int) {
		for i := range n {
			agg := fmt.Sprintf("o-%d", i%7)
			add(t, e.db.Pool, &w, event(agg, "Step"))
			want[agg]++
		}
	}
	for range 3 {
		write(20)
		before := walsender()
		if n := proxy.cut(200 * time.Millisecond); n == 0 {
			t.Fatal("no connection to cut")
		}
		write(20)
		eventually(t, 20*time.Second, "another walsender streams the slot", func() (bool, error) {
			pid := walsender()
			return pid != 0 && pid != before && r.State().Streaming, nil
		})
	}
	eventually(t, 30*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NULL") == 0, nil
	})
	inOrder(t, seqsBySubject(t, e.stream), want)
}

// cutter is a TCP proxy to the test's Postgres whose connections the test
// cuts all at once, as a network fault or a server gone does: the client
// reads a reset, not a message, and for a moment nothing answers.
type cutter struct {
	addr, target string
	mu           sync.Mutex
	ln           net.Listener
	conns        []net.Conn
	done         bool
}

func newCutter(t testing.TB, dbURL string) *cutter {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{addr: "127.0.0.1:0", target: u.Host}
	if err := c.listen(); err != nil {
		t.Fatal(err)
	}
	c.addr = c.ln.Addr().String()
	t.Cleanup(func() {
		c.mu.Lock()
		c.done = true
		c.mu.Unlock()
		c.cut(0)
	})
	return c
}

func (c *cutter) listen() error {
	ln, err := net.Listen("tcp", c.addr)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.ln = ln
	c.mu.Unlock()
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", c.target)
			if err != nil {
				client.Close()
				continue
			}
			c.mu.Lock()
			c.conns = append(c.conns, client, server)
			c.mu.Unlock()
			go func() { _, _ = io.Copy(server, client); server.Close() }()
			go func() { _, _ = io.Copy(client, server); client.Close() }()
		}
	}()
	return nil
}

// cut resets every connection through the proxy, refuses new ones for
// down, and returns how many client connections it cut.
func (c *cutter) cut(down time.Duration) int {
	c.mu.Lock()
	c.ln.Close()
	for _, conn := range c.conns {
		if tc, ok := conn.(*net.TCPConn); ok {
			_ = tc.SetLinger(0) // a reset, not an orderly end
		}
		conn.Close()
	}
	n := len(c.conns) / 2
	c.conns = nil
	done := c.done
	c.mu.Unlock()
	if !done {
		time.AfterFunc(down, func() {
			c.mu.Lock()
			done := c.done
			c.mu.Unlock()
			if !done {
				_ = c.listen() // the same port; a test whose cutter cannot listen again times out waiting
			}
		})
	}
	return n
}

// pool returns a pool like the schema's whose connections, the relay's
// replication connection among them, go through the proxy.
func (c *cutter) pool(t testing.TB, dbURL string) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = c.addr
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
