//go:build shopbench

package benchsuite

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
)

// Rows 11 to 13 set the two relays of issue 26 side by side, in the same
// run and interleaved (ModeCDC, ModePoll, the ceilings, again and again),
// so that the machine's drift over minutes falls on both alike.
//
// Row 11 drains a backlog on a database of its own, not on a schema of the
// shared test database: its transactions per event are pg_stat_database's
// xact_commit, which counts per database, and other processes' work in
// shop_test would land in it. Its Postgres CPU is the CPU time of the server
// processes serving that database (the relay's sessions and, in ModeCDC,
// the walsender decoding the slot), read from /proc/<pid>/stat; the
// server's background processes (WAL writer, checkpointer, autovacuum) are
// shared by every database and are not in it.

// cdcDB is a throwaway database with the eventing tables in schema bench.
type cdcDB struct {
	db    pgtest.Database
	admin *pgxpool.Pool
}

const cdcSchema = "bench"

func newCDCDB(tb testing.TB) *cdcDB {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d := &cdcDB{db: pgtest.NewDatabase(tb, "bench_relay_")}
	if err := migrations.Apply(ctx, d.db.URL, cdcSchema, nil, nil); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	// One session, so that "every session but pg_backend_pid()" is
	// every session but the admin's.
	d.admin = d.pool(tb, 1)
	// Registered after the database's drop, so it runs before it: a slot
	// left in the database would make DROP DATABASE fail, and a slot
	// left on the cluster pins WAL for everyone.
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		rows, err := d.admin.Query(ctx, `SELECT slot_name FROM pg_replication_slots WHERE database = current_database()`)
		if err != nil {
			tb.Error(err)
			return
		}
		slots, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			tb.Error(err)
		}
		for _, s := range slots {
			if err := outbox.DropSlot(ctx, d.admin, s); err != nil {
				tb.Error(err)
			}
		}
	})
	return d
}

func (d *cdcDB) pool(tb testing.TB, n int32) *pgxpool.Pool {
	tb.Helper()
	p, err := database.NewPool(context.Background(), d.db.URL, cdcSchema, n)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// xacts is the database's committed transactions, once every session
// but the admin pool's has ended (a session flushes its counts as it
// ends) and the admin session has flushed its own.
func (d *cdcDB) xacts(tb testing.TB) int64 {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		var others int
		if err := d.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&others); err != nil {
			tb.Fatal(err)
		}
		if others == 0 {
			break
		}
		select {
		case <-ctx.Done():
			tb.Fatalf("%d sessions still on %s after 30 s", others, d.db.Name)
		case <-time.After(10 * time.Millisecond):
		}
	}
	return d.xactsWithRelay(tb)
}

// backendCPU is the CPU time (user + system, seconds) so far of every
// server process connected to the database but this pool's own session,
// by pid: the relay's sessions and the walsender.
func (d *cdcDB) backendCPU(tb testing.TB) map[int]float64 {
	tb.Helper()
	rows, err := d.admin.Query(context.Background(), `SELECT pid FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()`)
	if err != nil {
		tb.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		tb.Fatal(err)
	}
	out := map[int]float64{}
	for _, pid := range pids {
		if s, ok := procCPU(int(pid)); ok {
			out[int(pid)] = s
		}
	}
	return out
}

// procCPU reads utime + stime of a process from /proc/<pid>/stat.
func procCPU(pid int) (float64, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The command name, in parentheses, may hold spaces: fields count
	// from after its closing parenthesis (state is field 3, utime 14).
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, false
	}
	u, err1 := strconv.ParseFloat(f[11], 64)
	st, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return (u + st) / ticksPerSecond, true
}

// cpuSince sums, over the processes of now, their CPU since before (a
// process not in before started since, and counts from zero).
func cpuSince(before, now map[int]float64) float64 {
	var s float64
	for pid, c := range now {
		s += c - before[pid]
	}
	return s
}

// drainFigures are one drain of row 11.
type drainFigures struct {
	rate     float64 // events/s
	busy     float64 // machine CPU busy meanwhile, %
	pgCPU    float64 // Postgres CPU per event, µs (the database's sessions and walsender)
	txPerEv  float64 // committed transactions per 1,000 events (per event would print 0.00: batches of 500)
	streamed bool    // ModeCDC: the stream, not the poller, published them (HandedOff 0)
}

// relayDrainMode drains sz.backlog events with one relay in mode. In
// ModePoll the backlog is committed first, then the relay starts, as row 2
// does. In ModeCDC the relay starts first and streams (State().Streaming)
// before the backlog commits, so that the stream, not the relay's poller,
// drains it; the clock starts when the backlog's COPY has committed.
func relayDrainMode(b *testing.B, sz sizes, mode outbox.Mode) drainFigures {
	return scoped(b, func(tb testing.TB) drainFigures {
		d := newCDCDB(tb)
		nats := natstest.New(tb)
		_, js := nats.Connect(tb)
		nats.Stream(tb, js, "EV", "ev.>")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		pool := d.pool(tb, 5)
		// ModePoll polls every 5 ms as row 2's relays do: between two
		// batches a wait would measure the interval, not the relay. In
		// ModeCDC the poll interval only paces the poller that takes
		// hand-offs, whose empty claims at 5 ms would be most of the
		// row's transactions: it runs with the default (1 s), as the
		// services run it.
		cfg := outbox.Config{Name: "r0", Mode: mode}
		if mode == outbox.ModePoll {
			cfg.PollInterval = 5 * time.Millisecond
		}
		r := quietRelay(tb, pool, js, cfg)
		var wg sync.WaitGroup
		defer wg.Wait()
		defer cancel()
		if mode == outbox.ModeCDC {
			wg.Go(func() { _ = r.Run(ctx) })
			deadline := time.Now().Add(time.Minute)
			for !r.State().Streaming {
				if st := r.State(); st.CDCUnavailable != "" || time.Now().After(deadline) {
					tb.Fatalf("the CDC relay does not stream: %+v", st)
				}
				time.Sleep(2 * time.Millisecond)
			}
		}
		var x0 int64
		var start time.Time
		var cpu0 cpuSample
		var pg0 map[int]float64
		if mode == outbox.ModeCDC {
			// The stream starts on the COPY's commit: the counts are
			// read before it, the clock starts as it returns. The COPY's
			// session is the admin's, which backendCPU leaves out.
			x0, pg0 = d.xactsWithRelay(tb), d.backendCPU(tb)
			copyBacklog(tb, d.admin, sz.backlog, false, "o-")
			start, cpu0 = time.Now(), readCPU()
		} else {
			fillBacklog(tb, d.admin, sz.backlog, false, "o-")
			x0, pg0 = d.xactsWithRelay(tb), d.backendCPU(tb)
			start, cpu0 = time.Now(), readCPU()
			wg.Go(func() { _ = r.Run(ctx) })
		}
		deadline := time.Now().Add(5 * time.Minute)
		for r.Counters().Published < int64(sz.backlog) {
			if time.Now().After(deadline) {
				tb.Fatalf("relay drain (%s): %d of %d published after 5 minutes", mode, r.Counters().Published, sz.backlog)
			}
			time.Sleep(2 * time.Millisecond)
		}
		el, cpu1, pg1 := time.Since(start), readCPU(), d.backendCPU(tb) // the walsender is still there
		st := r.State()
		cancel()
		wg.Wait()
		pool.Close()
		x1 := d.xacts(tb)
		n := float64(sz.backlog)
		return drainFigures{rate: n / el.Seconds(), busy: busyShare(cpu0, cpu1), pgCPU: 1e6 * cpuSince(pg0, pg1) / n,
			txPerEv: 1000 * float64(x1-x0) / n, streamed: st.HandedOff == 0}
	})
}

// xactsWithRelay is the database's committed transactions without waiting
// for the other sessions to end, which a running relay's cannot: the admin
// pool's sessions flush their counts first, and a relay's sessions flush
// theirs within a second of going idle on an empty outbox, so the error
// is a few transactions in 50,000. xacts waits for them to end instead.
func (d *cdcDB) xactsWithRelay(tb testing.TB) int64 {
	tb.Helper()
	ctx := context.Background()
	for _, c := range d.admin.AcquireAllIdle(ctx) {
		_, err := c.Exec(ctx, "SELECT pg_stat_force_next_flush()")
		c.Release()
		if err != nil {
			tb.Fatal(err)
		}
	}
	var n int64
	if err := d.admin.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n); err != nil {
		tb.Fatal(err)
	}
	return n
}

// dbOnlyCeiling is the database-only ceiling of each mode on a fresh
// database, publishing nothing. ModePoll: the poller's own claimSQL and
// markSQL, one loop (row 1's ceiling). ModeCDC: the slot decoded by
// the server with nothing published and nothing marked
// (pg_logical_slot_get_binary_changes with pgoutput and a publication as
// the relay's): what the walsender must do for the events at least. The
// CDC relay also marks the rows published, in batches (markCDCSQL, an
// UPDATE by event id like markSQL without the claim token), which this
// ceiling leaves out: it would need the ids decoded from pgoutput's
// binary messages, the relay's own work.
func dbOnlyCeiling(b *testing.B, sz sizes, mode outbox.Mode) drainFigures {
	return scoped(b, func(tb testing.TB) drainFigures {
		d := newCDCDB(tb)
		ctx := context.Background()
		const slot = "bench_ceiling"
		name := slot + "_" + d.db.Name // slots are per cluster
		if mode == outbox.ModeCDC {
			if _, err := d.admin.Exec(ctx, `CREATE PUBLICATION `+pgx.Identifier{name}.Sanitize()+
				` FOR TABLE outbox WITH (publish = 'insert')`); err != nil {
				tb.Fatal(err)
			}
			if _, err := d.admin.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, name); err != nil {
				tb.Fatal(err)
			}
		}
		fillBacklog(tb, d.admin, sz.backlog, false, "o-")
		pool := d.pool(tb, 3)
		x0 := d.xactsWithRelay(tb)
		start, cpu0 := time.Now(), readCPU()
		var done int
		var pgCPU float64
		if mode == outbox.ModeCDC {
			// One session decodes; its CPU is the decoding's.
			conn, err := pool.Acquire(ctx)
			if err != nil {
				tb.Fatal(err)
			}
			pid := int(conn.Conn().PgConn().PID())
			c0, _ := procCPU(pid)
			var msgs int
			if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_logical_slot_get_binary_changes($1, NULL, NULL,
				'proto_version', '1', 'publication_names', $2)`, name, name).Scan(&msgs); err != nil {
				conn.Release()
				tb.Fatal(err)
			}
			c1, _ := procCPU(pid)
			conn.Release()
			pgCPU = c1 - c0
			// BEGIN, RELATION, an INSERT per event, COMMIT.
			if msgs < sz.backlog {
				tb.Fatalf("decoded %d messages, want at least %d", msgs, sz.backlog)
			}
			done = sz.backlog
		} else {
			stmts := readRelayStatements(tb)
			pg0 := d.backendCPU(tb)
			for done < sz.backlog {
				n, err := stmts.claimAndMark(ctx, pool, "db-only", relayBatch)
				if err != nil {
					tb.Fatal(err)
				}
				if n == 0 {
					tb.Fatalf("DB-only: %d of %d marked, none left to claim", done, sz.backlog)
				}
				done += n
			}
			pgCPU = cpuSince(pg0, d.backendCPU(tb))
		}
		el, cpu1 := time.Since(start), readCPU()
		pool.Close()
		x1 := d.xacts(tb)
		n := float64(done)
		return drainFigures{rate: n / el.Seconds(), busy: busyShare(cpu0, cpu1), pgCPU: 1e6 * pgCPU / n, txPerEv: 1000 * float64(x1-x0) / n}
	})
}

// cdcRows runs rows 11 to 13 into t.
func cdcRows(b *testing.B, t *table, sz sizes) {
	modes := []outbox.Mode{outbox.ModeCDC, outbox.ModePoll}
	if wanted("11") {
		type series struct{ rate, busy, pg, tx []float64 }
		add := func(s *series, f drainFigures) {
			s.rate, s.busy, s.pg, s.tx = append(s.rate, f.rate), append(s.busy, f.busy), append(s.pg, f.pgCPU), append(s.tx, f.txPerEv)
		}
		relay := map[outbox.Mode]*series{outbox.ModeCDC: {}, outbox.ModePoll: {}}
		ceil := map[outbox.Mode]*series{outbox.ModeCDC: {}, outbox.ModePoll: {}}
		handedOff := 0
		for range *runs {
			for _, m := range modes {
				f := relayDrainMode(b, sz, m)
				if m == outbox.ModeCDC && !f.streamed {
					handedOff++
				}
				add(relay[m], f)
			}
			for _, m := range modes {
				add(ceil[m], dbOnlyCeiling(b, sz, m))
			}
		}
		k := fmtNum(float64(sz.backlog))
		for _, m := range modes {
			s := relay[m]
			t.add("11", fmt.Sprintf("relay drain %s, 1 relay, %s", k, m), "events/s", s.rate)
			t.add("11", fmt.Sprintf("  Postgres CPU per published event (%s)", m), "µs", s.pg)
			t.add("11", fmt.Sprintf("  database transactions per 1,000 published events (%s)", m), "tx", s.tx)
			t.add("11", fmt.Sprintf("  machine CPU busy meanwhile (%s)", m), "%", s.busy)
		}
		for _, m := range modes {
			s := ceil[m]
			what := "claimSQL + markSQL, one loop"
			if m == outbox.ModeCDC {
				what = "slot decoded by pgoutput, nothing published or marked"
			}
			t.add("11", fmt.Sprintf("DB-only ceiling %s (%s): %s", k, m, what), "events/s", s.rate)
			t.add("11", fmt.Sprintf("  Postgres CPU per event (ceiling, %s)", m), "µs", s.pg)
		}
		if handedOff > 0 {
			t.add("11", "  CDC runs in which the stream handed events to the poller", "runs", []float64{float64(handedOff)})
		}
		cdc, poll := fmt.Sprintf("relay drain %s, 1 relay, %s", k, outbox.ModeCDC), fmt.Sprintf("relay drain %s, 1 relay, %s", k, outbox.ModePoll)
		t.ratio(poll, fmt.Sprintf("DB-only ceiling %s (%s): claimSQL + markSQL, one loop", k, outbox.ModePoll), "of its DB-only ceiling", "")
		t.ratio(cdc, fmt.Sprintf("DB-only ceiling %s (%s): slot decoded by pgoutput, nothing published or marked", k, outbox.ModeCDC), "of decoding alone", "")
		if r := t.find(cdc); r != nil {
			first := r.ratio
			t.ratio(cdc, poll, "of poll, same run", "")
			if first != "" {
				r.ratio += "; " + first
			}
		}
		for _, what := range []string{"  Postgres CPU per published event (%s)", "  database transactions per 1,000 published events (%s)"} {
			t.ratio(fmt.Sprintf(what, outbox.ModeCDC), fmt.Sprintf(what, outbox.ModePoll), "of poll, same run", "")
		}
	}
	if wanted("12") {
		var cons [2][3][]float64
		var busy [2][]float64
		for range *runs {
			for j, m := range modes {
				l := latency(b, sz, true, 5*time.Millisecond, 0, m)
				for i := range 3 {
					cons[j][i] = append(cons[j][i], l.cons[i])
				}
				busy[j] = append(busy[j], l.busy)
			}
		}
		for j, m := range modes {
			for i, q := range []string{"p50", "p99", "max"} {
				t.add("12", fmt.Sprintf("500 ev/s %s: commit→consumer commit %s", m, q), "ms", cons[j][i])
			}
			t.add("12", fmt.Sprintf("  machine CPU busy meanwhile (%s)", m), "%", busy[j])
		}
		for _, q := range []string{"p50", "p99"} {
			t.ratio(fmt.Sprintf("500 ev/s %s: commit→consumer commit %s", outbox.ModeCDC, q),
				fmt.Sprintf("500 ev/s %s: commit→consumer commit %s", outbox.ModePoll, q), "of poll, same run", "")
		}
	}
	if wanted("13") {
		// RELAY_MODE is read by internal/config once the shop has it; a
		// shop that predates it ignores it and polls. The row says which
		// mode each run asked for, and how many replication slots the
		// shop's database had at the end of the load: 0 in a run that
		// asked for cdc means the shop polled.
		var rate, txs, cpu, busy, slots, rss [2][]float64
		for range *runs {
			for j, m := range modes {
				r := sagaWith(b, sz, []string{"RELAY_MODE=" + string(m)})
				rate[j], txs[j], cpu[j] = append(rate[j], r.rate), append(txs[j], r.txPerOrder), append(cpu[j], r.cpuPerOrder)
				busy[j], slots[j], rss[j] = append(busy[j], r.busy), append(slots[j], r.slots), append(rss[j], r.rssMB)
			}
		}
		secs := *sagaSeconds
		if *quick {
			secs = 4
		}
		for j, m := range modes {
			t.add("13", fmt.Sprintf("whole saga, %d s at %g orders/s, RELAY_MODE=%s asked: COMPLETED/s", secs, *sagaRate, m), "orders/s", rate[j])
			t.add("13", fmt.Sprintf("  database transactions per completed order (RELAY_MODE=%s)", m), "tx", txs[j])
			t.add("13", fmt.Sprintf("  machine CPU per completed order (RELAY_MODE=%s)", m), "ms", cpu[j])
			t.add("13", fmt.Sprintf("  machine CPU busy in the measured window (RELAY_MODE=%s)", m), "%", busy[j])
			t.add("13", fmt.Sprintf("  replication slots of the shop's database at end of load (RELAY_MODE=%s)", m), "slots", slots[j])
			t.add("13", fmt.Sprintf("  peak RSS of shop all, VmHWM (RELAY_MODE=%s)", m), "MB", rss[j])
		}
		for _, what := range []string{
			"whole saga, %d s at %g orders/s, RELAY_MODE=%s asked: COMPLETED/s",
		} {
			t.ratio(fmt.Sprintf(what, secs, *sagaRate, outbox.ModeCDC), fmt.Sprintf(what, secs, *sagaRate, outbox.ModePoll), "of poll, same run", "")
		}
		for _, what := range []string{"  database transactions per completed order (RELAY_MODE=%s)", "  machine CPU per completed order (RELAY_MODE=%s)"} {
			t.ratio(fmt.Sprintf(what, outbox.ModeCDC), fmt.Sprintf(what, outbox.ModePoll), "of poll, same run", "")
		}
	}
}

func TestProcCPU(t *testing.T) {
	// Burn some CPU so that this process's count is above zero.
	deadline := time.Now().Add(50 * time.Millisecond)
	for x := 0; time.Now().Before(deadline); x++ {
		_ = x * x
	}
	if s, ok := procCPU(os.Getpid()); !ok || s <= 0 {
		t.Errorf("procCPU(self) = %v, %v; want a positive CPU time", s, ok)
	}
	if _, ok := procCPU(-1); ok {
		t.Error("procCPU(-1) read something")
	}
	before := map[int]float64{1: 2, 2: 5}
	now := map[int]float64{1: 3, 2: 5.5, 3: 0.25} // 3 started in between
	if got := cpuSince(before, now); got != 1.75 {
		t.Errorf("cpuSince = %v, want 1.75", got)
	}
}
