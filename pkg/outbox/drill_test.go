package outbox

// The backlog drill of issue 4: the relays are down while 50,000 events are
// committed; then they start, and the test records how long they take to
// drain the backlog, checks that every aggregate's events reached the stream
// in sequence order, exactly once, and that the claim query stayed on the
// partial index outbox_pending (bounded database load however long the
// backlog) — both in the planner's plan and in Postgres's scan counters
// during the drain.
//
// It is a test, not a benchmark: the drain time is logged (go test -v -run
// TestBacklogDrill ./pkg/outbox), never asserted, because the machine is
// shared. -short drills 10,000 events instead.

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/internal/testenv"
)

const (
	drillEvents     = 50_000
	drillAggregates = 10_000 // five events per order
	drillRelays     = 2      // two service processes, each with the default two workers
)

func TestBacklogDrill(t *testing.T) {
	// Not parallel: the drain time should not include other tests' load.
	n := drillEvents
	if testing.Short() {
		n = 10_000
	}
	ctx := context.Background()
	e := &env{db: newSchema(t), nats: testenv.NATS(t)}
	_, e.js = e.nats.Connect(t)
	e.stream = e.nats.Stream(t, e.js, "EV", "ev.>")

	// Some history first: published rows, as 72 hours of retention keep
	// them. The claim must not read them.
	fillDrill(t, e, n, drillAggregates, 0, "Old", true)

	// The relays are down (not started) while the backlog is committed.
	start := time.Now()
	fillDrill(t, e, n, drillAggregates, int64(n/drillAggregates), "Step", false)
	t.Logf("committed %d pending events over %d aggregates in %v", n, drillAggregates, time.Since(start).Round(time.Millisecond))
	if _, err := e.db.Pool.Exec(ctx, `ANALYZE outbox`); err != nil { // as autovacuum would after such a load
		t.Fatal(err)
	}

	// With the backlog present, the claim query's plan, as the relay's
	// first executions get it (custom plan, with the batch size) and as a
	// cached prepared statement may later get it (generic plan).
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		plan := explainClaim(t, e, mode)
		scans := planScans(plan)
		t.Logf("claim plan (%s): %s", mode, strings.Join(scans, ", "))
		if !containsString(scans, "Index Scan on outbox using outbox_pending") &&
			!containsString(scans, "Index Only Scan on outbox using outbox_pending") {
			t.Errorf("%s: claim query does not use index outbox_pending: %s", mode, plan)
		}
		for _, s := range scans {
			// outbox_relays, a row per live relay, may be read whole.
			if strings.HasPrefix(s, "Seq Scan on outbox") && !strings.HasPrefix(s, "Seq Scan on outbox_relays") {
				t.Errorf("%s: claim query scans the whole outbox (%s): %s", mode, s, plan)
			}
		}
	}

	// Counted before: everything the set-up's sessions did (the
	// migration's session has ended, the pool's are flushed here), so
	// that the difference is the relays' alone.
	e.db.FlushStats(t)
	before := tableScans(t, e)
	const relayApp = "outbox-drill-relays"
	relayPool := e.db.NewAppPool(t, 10, relayApp) // closed below, so its sessions report their scan counts
	relays := make([]*Relay, drillRelays)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, drillRelays)
	start = time.Now()
	for i := range relays {
		r, err := NewRelay(relayPool, e.js, Config{Name: fmt.Sprint("drill-", i), Logger: cmpLogger(nil)})
		if err != nil {
			t.Fatal(err)
		}
		relays[i] = r
		go func() { done <- r.Run(runCtx) }()
	}
	// Drained when the relays have marked every event: counted in memory,
	// so that waiting adds no queries of its own to the outbox.
	published := func() int64 {
		var p int64
		for _, r := range relays {
			p += r.Counters().Published
		}
		return p
	}
	deadline := time.Now().Add(5 * time.Minute)
	for published() < int64(n) {
		if time.Now().After(deadline) {
			t.Fatalf("not drained after 5 minutes: %d of %d published", published(), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	drain := time.Since(start)
	stop()
	var total Counters
	for _, r := range relays {
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
		c := r.Counters()
		total.Published += c.Published
		total.Duplicates += c.Duplicates
		total.Retried += c.Retried
		total.Dead += c.Dead
	}
	relayPool.Close()
	t.Logf("drained %d events with %d relays in %v: %.0f events/s (published %d, broker duplicates %d, retried %d, dead %d)",
		n, drillRelays, drain.Round(time.Millisecond), float64(n)/drain.Seconds(),
		total.Published, total.Duplicates, total.Retried, total.Dead)
	if total.Published != int64(n) || total.Dead != 0 {
		t.Errorf("published %d and dead %d, want %d and 0", total.Published, total.Dead, n)
	}

	// Bounded load, measured: during the drain nothing read the outbox
	// sequentially, and the pending index served the claims.
	e.db.WaitSessionsEnded(t, relayApp)
	after := tableScans(t, e)
	t.Logf("during the drain: %d sequential scans of outbox, %d scans of outbox_pending, %d point lookups in outbox's other indexes (primary key, sequence key)",
		after.seq-before.seq, after.pending-before.pending, after.other-before.other)
	if after.seq != before.seq {
		t.Errorf("the outbox was scanned sequentially %d times during the drain", after.seq-before.seq)
	}
	if got := count(t, e.db.Pool, "published_at IS NULL"); got != 0 {
		t.Errorf("%d events still unpublished", got)
	}

	checkStreamOrder(t, e, n)
}

// fillDrill commits n events of type typ spread over aggregates, in bulk
// (COPY), with UUIDv7 ids as Writer gives them, so that claim order follows
// commit order as in production; published marks them all published an
// hour ago (history, not backlog). Each aggregate's sequence continues
// from base, the last sequence the outbox already holds for it. (Asking
// the outbox for it with max(aggregate_seq) would scan it sequentially,
// and that scan could be counted late, during the drain.)
func fillDrill(t *testing.T, e *env, n, aggregates int, base int64, typ string, published bool) {
	t.Helper()
	ctx := context.Background()
	payload := `{"blob":"` + strings.Repeat("x", 500) + `"}`
	var at *time.Time
	if published {
		p := time.Now().Add(-time.Hour)
		at = &p
	}
	rows := make([][]any, n)
	for i := range rows {
		agg := fmt.Sprint("o-", i%aggregates)
		rows[i] = []any{uuid.Must(uuid.NewV7()), "order", agg, base + int64(i/aggregates+1), typ, int32(1),
			"ev." + agg + "." + typ, payload, at}
	}
	_, err := e.db.Pool.CopyFrom(ctx, pgx.Identifier{"outbox"},
		[]string{"event_id", "aggregate_type", "aggregate_id", "aggregate_seq", "event_type", "schema_version", "subject", "payload", "published_at"},
		pgx.CopyFromRows(rows))
	if err != nil {
		t.Fatal(err)
	}
}

// explainClaim returns the JSON plan of the relay's claim query under
// plan_cache_mode mode.
func explainClaim(t *testing.T, e *env, mode string) string {
	t.Helper()
	ctx := context.Background()
	var plan string
	err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = "+mode); err != nil {
			return err
		}
		// EXPLAIN without ANALYZE plans the UPDATE and runs nothing.
		return tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+claimSQL,
			500, "drill", uuid.New(), (30 * time.Second).Microseconds(), 0, nil).Scan(&plan)
	})
	if err != nil {
		t.Fatal(err)
	}
	return plan
}

// planScans lists the scans of a JSON plan as "<Node Type> on <relation>
// [using <index>]".
func planScans(plan string) []string {
	var doc []struct{ Plan map[string]any }
	if err := json.Unmarshal([]byte(plan), &doc); err != nil || len(doc) == 0 {
		return []string{"unparsable plan: " + plan}
	}
	var out []string
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		if rel, ok := n["Relation Name"].(string); ok {
			s := fmt.Sprintf("%s on %s", n["Node Type"], rel)
			if idx, ok := n["Index Name"].(string); ok {
				s += " using " + idx
			}
			out = append(out, s)
		}
		if kids, ok := n["Plans"].([]any); ok {
			for _, k := range kids {
				if m, ok := k.(map[string]any); ok {
					walk(m)
				}
			}
		}
	}
	walk(doc[0].Plan)
	return out
}

func containsString(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

type scans struct{ seq, pending, other int64 }

func tableScans(t *testing.T, e *env) scans {
	t.Helper()
	var s scans
	err := e.db.Pool.QueryRow(context.Background(), `
		SELECT (SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = current_schema() AND relname = 'outbox'),
		       (SELECT idx_scan FROM pg_stat_user_indexes WHERE schemaname = current_schema() AND indexrelname = 'outbox_pending'),
		       (SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes
		        WHERE schemaname = current_schema() AND relname = 'outbox' AND indexrelname <> 'outbox_pending')::bigint`).
		Scan(&s.seq, &s.pending, &s.other)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// checkStreamOrder reads the whole stream and checks that it holds each
// event once and every aggregate's Aggregate-Seq increases by one from
// message to message, from the history's last sequence on.
func checkStreamOrder(t *testing.T, e *env, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if got := streamMsgs(t, e.stream); got != uint64(n) {
		t.Errorf("stream holds %d messages, want %d", got, n)
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
	last := map[string]int64{}
	seen := map[string]bool{}
	var disorder int
	for i := range n {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			t.Fatalf("message %d of %d: %v", i+1, n, err)
		}
		h := m.Headers()
		id := h.Get(jetstream.MsgIDHeader)
		if seen[id] {
			t.Errorf("event %s is in the stream twice", id)
		}
		seen[id] = true
		agg := h.Get("Aggregate-Id")
		seq, err := strconv.ParseInt(h.Get("Aggregate-Seq"), 10, 64)
		if err != nil {
			t.Fatalf("message %d: Aggregate-Seq %q: %v", i+1, h.Get("Aggregate-Seq"), err)
		}
		prev, ok := last[agg]
		if !ok {
			prev = int64(n / drillAggregates) // the history's last sequence
		}
		if seq != prev+1 {
			disorder++
			if disorder <= 10 {
				t.Errorf("aggregate %s: seq %d after %d in stream order", agg, seq, prev)
			}
		}
		last[agg] = seq
	}
	if len(last) != drillAggregates {
		t.Errorf("stream has events of %d aggregates, want %d", len(last), drillAggregates)
	}
	t.Logf("stream order: %d messages, %d aggregates, %d out of order", n, len(last), disorder)
}
