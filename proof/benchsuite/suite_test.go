//go:build shopbench

package benchsuite

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services/order"
)

var (
	runs        = flag.Int("suite.runs", 3, "runs per row (the table shows median, min and max)")
	quick       = flag.Bool("suite.quick", false, "tiny sizes: a smoke test of the suite, not a measurement")
	sagaSeconds = flag.Int("suite.saga-seconds", 60, "length of one whole-saga run (row 6)")
	sagaRate    = flag.Float64("suite.saga-rate", 250, "orders started per second in the whole-saga run (row 6)")
	only        = flag.String("suite.only", "", "comma-separated row groups to run (1…13; 8 comes with 6; 7c, inventory's consumer drain, with 7 or alone; 11–13 are the relay's two modes side by side); empty: all")
)

// sizes; -suite.quick shrinks them.
type sizes struct {
	backlog     int // relay backlog (rows 1, 2, 7)
	jsMsgs      int
	orderTx     int // order transactions per run (rows 1, 3)
	latencySecs int
	httpOrders  int
	kept        int // rows kept in outbox / processed_events (row 7)
	consumed    int // messages per consumer run (row 7)
}

func getSizes() sizes {
	if *quick {
		return sizes{backlog: 2000, jsMsgs: 2000, orderTx: 400, latencySecs: 1, httpOrders: 300, kept: 20_000, consumed: 1000}
	}
	return sizes{backlog: 50_000, jsMsgs: 50_000, orderTx: 9600, latencySecs: 5, httpOrders: 4000, kept: 1_000_000, consumed: 20_000}
}

// ---- the table ----

type result struct {
	group   string
	what    string
	unit    string
	samples []float64
	ratio   string // filled in at the end: ratio to a ceiling, target
}

type table struct {
	mu   sync.Mutex
	rows []*result
}

func (t *table) add(group, what, unit string, samples []float64) *result {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := &result{group: group, what: what, unit: unit, samples: samples}
	t.rows = append(t.rows, r)
	return r
}

func (t *table) find(what string) *result {
	for _, r := range t.rows {
		if r.what == what {
			return r
		}
	}
	return nil
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func fmtNum(x float64) string {
	switch {
	case x >= 1000:
		s := fmt.Sprintf("%.0f", x)
		var out []byte
		for i, c := range []byte(s) {
			if i > 0 && (len(s)-i)%3 == 0 {
				out = append(out, ',')
			}
			out = append(out, c)
		}
		return string(out)
	case x >= 100:
		return fmt.Sprintf("%.0f", x)
	case x >= 10:
		return fmt.Sprintf("%.1f", x)
	default:
		return fmt.Sprintf("%.2f", x)
	}
}

func (t *table) print() {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 1, ' ', tabwriter.Debug)
	fmt.Fprintf(os.Stdout, "\nshop whole-system benchmark: %d run(s) per row, GOMAXPROCS %d, %s\n\n", *runs, runtime.GOMAXPROCS(0), time.Now().UTC().Format(time.RFC3339))
	fmt.Fprintln(w, " row\t what\t median\t min\t max\t unit\t n\t ratio / target")
	for _, r := range t.rows {
		if len(r.samples) == 0 {
			fmt.Fprintf(w, " %s\t %s\t -\t -\t -\t %s\t 0\t %s\n", r.group, r.what, r.unit, r.ratio)
			continue
		}
		fmt.Fprintf(w, " %s\t %s\t %s\t %s\t %s\t %s\t %d\t %s\n", r.group, r.what,
			fmtNum(median(r.samples)), fmtNum(slices.Min(r.samples)), fmtNum(slices.Max(r.samples)), r.unit, len(r.samples), r.ratio)
	}
	w.Flush()
	fmt.Println()
}

// ratio sets r's ratio column to median(r)/median(of) with the target.
func (t *table) ratio(what, of, label, target string) {
	r, base := t.find(what), t.find(of)
	if r == nil || base == nil || len(r.samples) == 0 || len(base.samples) == 0 {
		return
	}
	r.ratio = fmt.Sprintf("%.2f× %s", median(r.samples)/median(base.samples), label)
	if target != "" {
		r.ratio += " (target " + target + ")"
	}
}

func wanted(group string) bool {
	if *only == "" {
		return true
	}
	return slices.Contains(strings.Split(*only, ","), group)
}

// BenchmarkSystem runs every row of the table and prints it. Run it with
// -benchtime=1x (make bench does): one iteration is the whole suite.
func BenchmarkSystem(b *testing.B) {
	if testing.Short() {
		b.Skip("the system benchmark takes minutes")
	}
	b.Cleanup(func() {
		if binPath != "" {
			os.RemoveAll(filepath.Dir(binPath))
		}
	})
	t := &table{}
	sz := getSizes()
	for range b.N {
		if wanted("1") {
			t.add("1", "JetStream async publish, 1 KiB + msg id", "msgs/s", repeat(b, func() float64 { return jsPublish(b, sz) }))
			t.add("1", "order-creation SQL direct, 8 clients", "tx/s", repeat(b, func() float64 { return orderSQL(b, sz, 8, true).rate }))
			m32 := repeatMeasured(b, func() measured { return orderSQL(b, sz, 32, true) })
			t.add("1", "order-creation SQL direct, 32 clients", "tx/s", m32.rates)
			t.add("1", "  machine CPU busy meanwhile (32 clients)", "%", m32.busy)
			m := repeatMeasured(b, func() measured { return dbOnly(b, sz, 1) })
			t.add("1", "DB-only claim + mark (50k backlog)", "events/s", m.rates)
			t.add("1", "  machine CPU busy meanwhile (one client loop)", "%", m.busy)
			m = repeatMeasured(b, func() measured { return dbOnly(b, sz, 2) })
			t.add("1", "DB-only claim + mark, 2 loops side by side", "events/s", m.rates)
			t.add("1", "  machine CPU busy meanwhile (two client loops)", "%", m.busy)
		}
		if wanted("2") {
			for _, n := range []int{1, 2, 4} {
				m := repeatMeasured(b, func() measured { return relayDrain(b, sz, n) })
				t.add("2", fmt.Sprintf("relay drain 50k, %d relay(s) × 2 workers", n), "events/s", m.rates)
				t.add("2", fmt.Sprintf("  machine CPU busy meanwhile (%d relay(s))", n), "%", m.busy)
			}
		}
		if wanted("3") {
			// Interleaved, so that the machine's drift over the minutes of
			// the row does not land on one side of the ratio.
			var without, with []float64
			for range *runs {
				without = append(without, orderSQL(b, sz, 8, false).rate)
				with = append(with, orderSQL(b, sz, 8, true).rate)
			}
			t.add("3", "write path, order tx, no outbox, 8 clients", "tx/s", without)
			t.add("3", "write path, order tx + outbox, 8 clients", "tx/s", with)
		}
		if wanted("4") {
			modes := []struct {
				name   string
				wake   bool
				notify time.Duration // the writer's NotifyInterval
				batch  int           // the consumer's BatchSize; 0: the inbox default
			}{
				{"wake-up", true, 5 * time.Millisecond, 0}, // as the services' writers
				// The same with a consumer that commits each delivery alone:
				// what batching costs a lone delivery, same run.
				{"wake-up, consumer BatchSize 1", true, 5 * time.Millisecond, 1},
				{"wake-up, NOTIFY every commit", true, 0, 0},
				{"polling 100ms", false, 0, 0},
			}
			// Interleaved, run by run, so that the machine's drift within
			// minutes falls on every mode alike.
			acks := make([][3][]float64, len(modes))
			cons := make([][3][]float64, len(modes))
			busy := make([][]float64, len(modes))
			for range *runs {
				for j, m := range modes {
					l := latency(b, sz, m.wake, m.notify, m.batch, outbox.ModePoll)
					for i := range 3 {
						acks[j][i] = append(acks[j][i], l.ack[i])
						cons[j][i] = append(cons[j][i], l.cons[i])
					}
					busy[j] = append(busy[j], l.busy)
				}
			}
			for j, m := range modes {
				for i, q := range []string{"p50", "p99", "max"} {
					t.add("4", fmt.Sprintf("500 ev/s %s: commit→PubAck %s", m.name, q), "ms", acks[j][i])
				}
				for i, q := range []string{"p50", "p99", "max"} {
					t.add("4", fmt.Sprintf("500 ev/s %s: commit→consumer commit %s", m.name, q), "ms", cons[j][i])
				}
				// What bounds the tail: each step of the path waits for a core.
				t.add("4", fmt.Sprintf("  machine CPU busy meanwhile (%s)", m.name), "%", busy[j])
			}
		}
		if wanted("5") {
			// Creation alone (-follow=false: no GET polling beside it),
			// 32 clients, over the 16 SKUs, as in row 6, in two settings.
			lg := []string{"-orders", fmt.Sprint(sz.httpOrders), "-concurrency", "32", "-follow=false", "-sku", skuList, "-timeout", "5m"}
			// First the order service on its own, run by run beside the
			// same statements sent directly (row 1's orderSQL, in the
			// same round trips), each on a fresh database: the ratio of
			// the two is what the HTTP path costs (HTTP, JSON, the
			// service's code, loadgen's client side) plus the relay
			// publishing OrderCreated, with no other service on the cores.
			// Beside each rate, the machine's CPU per order and the
			// part of it each client and the shop process took (the rest
			// is Postgres, and NATS for the order service), so that the
			// difference between the two settings can be accounted for.
			var direct, directBusy, directCPU, directClient []float64
			var alone, aloneP50, aloneP99, aloneBusy, aloneCPU, aloneShop, aloneClient []float64
			for range *runs {
				m := orderSQL(b, sz, 32, true)
				direct, directBusy = append(direct, m.rate), append(directBusy, m.busy)
				directCPU, directClient = append(directCPU, m.cpu), append(directClient, m.selfCPU)
				r := scoped(b, func(tb testing.TB) loadMeasured {
					s := startOrderAlone(tb, "alone")
					cpu0, shop0 := readCPU(), s.cpuSeconds()
					r := s.loadgen(tb, lg...)
					cpu1, shop1 := readCPU(), s.cpuSeconds()
					n := float64(sz.httpOrders)
					return loadMeasured{r, busyShare(cpu0, cpu1), 1000 * busySeconds(cpu0, cpu1) / n, 1000 * (shop1 - shop0) / n}
				})
				alone, aloneP50, aloneP99 = append(alone, r.createRate), append(aloneP50, r.createP50), append(aloneP99, r.createP99)
				aloneBusy, aloneCPU, aloneShop = append(aloneBusy, r.busy), append(aloneCPU, r.cpu), append(aloneShop, r.shopCPU)
				aloneClient = append(aloneClient, 1000*r.loadgenCPU/float64(sz.httpOrders))
			}
			t.add("5", directSQL5, "tx/s", direct)
			t.add("5", "  machine CPU busy meanwhile (direct SQL)", "%", directBusy)
			t.add("5", "  machine CPU per order (direct SQL)", "ms", directCPU)
			t.add("5", "    of it the SQL's client (the benchmark process)", "ms", directClient)
			t.add("5", postAlone, "orders/s", alone)
			t.add("5", "POST /orders p50, order service alone", "ms", aloneP50)
			t.add("5", "POST /orders p99, order service alone", "ms", aloneP99)
			t.add("5", "  machine CPU busy meanwhile (order service alone)", "%", aloneBusy)
			t.add("5", "  machine CPU per order (order service alone)", "ms", aloneCPU)
			t.add("5", "    of it shop order (HTTP, service, relay)", "ms", aloneShop)
			t.add("5", "    of it shop loadgen (the HTTP client)", "ms", aloneClient)
			// Then `shop all`: the same load while the rest of the saga
			// reserves stock for these orders on the same cores.
			var rate, p50, p99, busy []float64
			func() {
				// Shedding off: this row measures the HTTP path, and its
				// 4,000 orders outrun the saga on purpose.
				s := startShop(b, "http", "ORDER_MAX_BACKLOG=0")
				defer s.stop()
				for range *runs {
					cpu0 := readCPU()
					r := s.loadgen(b, lg...)
					rate, p50, p99 = append(rate, r.createRate), append(p50, r.createP50), append(p99, r.createP99)
					busy = append(busy, busyShare(cpu0, readCPU()))
					s.waitIdle(b, 3*time.Minute) // the next run starts on a shop with no backlog
				}
			}()
			t.add("5", postAll, "orders/s", rate)
			t.add("5", "POST /orders p50, shop all", "ms", p50)
			t.add("5", "POST /orders p99, shop all", "ms", p99)
			t.add("5", "  machine CPU busy meanwhile (shop all)", "%", busy)
		}
		if wanted("6") || wanted("8") {
			var rate, p99, backlog, oldest, unpublished, rss, txs, shed, busy, cpu []float64
			for range *runs {
				r := saga(b, sz)
				rate, p99, backlog, oldest, unpublished, rss = append(rate, r.rate), append(p99, r.p99), append(backlog, r.backlog),
					append(oldest, r.oldest), append(unpublished, r.unpublished), append(rss, r.rssMB)
				txs, shed = append(txs, r.txPerOrder), append(shed, r.shed)
				busy, cpu = append(busy, r.busy), append(cpu, r.cpuPerOrder)
			}
			secs := *sagaSeconds
			if *quick {
				secs = 4 // as saga() runs it
			}
			t.add("6", fmt.Sprintf("whole saga, %d s at %g orders/s offered: COMPLETED/s", secs, *sagaRate), "orders/s", rate)
			t.add("6", "order → COMPLETED p99 (orders done ≤ 15 s after the load)", "ms", p99)
			t.add("6", "database transactions per completed order", "tx", txs)
			t.add("6", "machine CPU busy in the measured window", "%", busy)
			t.add("6", "machine CPU per completed order (all processes)", "ms", cpu)
			t.add("6", "orders shed (503, admission control) during the load", "orders", shed)
			t.add("6", "at end of load: orders not yet ended", "orders", backlog)
			t.add("6", "at end of load: oldest unended order age", "ms", oldest)
			t.add("6", "at end of load: unpublished outbox rows", "events", unpublished)
			t.add("8", "peak RSS of shop all (VmHWM) during row 6", "MB", rss)
		}
		if wanted("7") {
			t.add("7", "relay drain 50k, empty outbox", "events/s", repeatMeasured(b, func() measured { return relayDrain(b, sz, 1) }).rates)
			t.add("7", fmt.Sprintf("relay drain 50k, %s published rows kept", fmtNum(float64(sz.kept))), "events/s", keptOutbox(b, sz))
			empty := repeatMeasured(b, func() measured {
				m := consumerDrain(b, sz, false)
				return measured{rate: m.rates[0], busy: m.busy[0]}
			})
			t.add("7", "consumer drain 20k, empty processed_events", "events/s", empty.rates)
			t.add("7", "  machine CPU busy meanwhile (empty processed_events)", "%", empty.busy)
			t.add("7", fmt.Sprintf("consumer drain 20k, %s rows in processed_events", fmtNum(float64(sz.kept))), "events/s", consumerDrain(b, sz, true).rates)
		}
		if wanted("7") || wanted("7c") {
			t.add("7c", fmt.Sprintf("consumer drain %s OrderCreated, inventory reservation handler, 16 SKUs", fmtNum(float64(sz.consumed/4))), "events/s",
				inventoryDrain(b, sz))
		}
		if wanted("9") {
			durability(b, t, sz)
		}
		if wanted("10") {
			tracing(b, t, sz)
		}
		// 11–13: the relay's two modes side by side (cdc_test.go).
		cdcRows(b, t, sz)
	}
	// The relay's ceiling is the better of the two database-only rates: a
	// relay's two workers claim side by side, which costs the database more
	// than one loop does, and may also use both cores.
	one, two := "DB-only claim + mark (50k backlog)", "DB-only claim + mark, 2 loops side by side"
	t.ratio(two, one, "of 1 loop", "")
	ceil, label := one, "of DB-only"
	if a, b := t.find(one), t.find(two); a != nil && b != nil && median(b.samples) > median(a.samples) {
		ceil, label = two, "of DB-only 2 loops"
	}
	// The targets are issue 16's; those it sets against 4f973e6 (the saga's
	// rate, CPU per order, inventory's drain) need that commit beside this
	// one, which a single run does not have (docs/performance.md).
	t.ratio("relay drain 50k, 1 relay(s) × 2 workers", ceil, label, "≥ 0.9")
	t.ratio("relay drain 50k, 2 relay(s) × 2 workers", "relay drain 50k, 1 relay(s) × 2 workers", "of 1 relay", "≥ 1.4")
	t.ratio("consumer drain 20k, empty processed_events", "relay drain 50k, empty outbox", "of relay drain", "≥ 0.8")
	t.ratio("500 ev/s wake-up: commit→consumer commit p99", "500 ev/s wake-up, consumer BatchSize 1: commit→consumer commit p99",
		"of BatchSize 1", "≤ 10 ms, and batching costs a lone delivery nothing")
	t.ratio("relay drain 50k, 4 relay(s) × 2 workers", "relay drain 50k, 1 relay(s) × 2 workers", "of 1 relay", "")
	t.ratio("write path, order tx + outbox, 8 clients", "write path, order tx, no outbox, 8 clients", "of no outbox", "≥ 0.85")
	t.ratio(postAlone, directSQL5, "of direct SQL 32, row 5", "≥ 0.8")
	t.ratio(postAll, directSQL5, "of direct SQL 32, row 5", "")
	t.ratio(fmt.Sprintf("relay drain 50k, %s published rows kept", fmtNum(float64(sz.kept))), "relay drain 50k, empty outbox", "of empty", "≥ 0.9")
	t.ratio(fmt.Sprintf("consumer drain 20k, %s rows in processed_events", fmtNum(float64(sz.kept))), "consumer drain 20k, empty processed_events", "of empty", "≥ 0.9")
	for _, r := range t.rows {
		switch {
		case strings.HasPrefix(r.what, "whole saga") && r.group == "6":
			r.ratio = "target ≥ 3× 4f973e6 (same machine, same hour), backlog bounded"
		case r.what == "database transactions per completed order":
			r.ratio = "target ≤ 10"
		case r.what == "machine CPU per completed order (all processes)":
			r.ratio = "target ≤ 0.35× 4f973e6 (same machine, same hour)"
		case strings.HasPrefix(r.what, "peak RSS"):
			r.ratio = "target ≤ 150 MB"
		}
	}
	t.print()
}

// The rows of group 5 that ratios name.
const (
	directSQL5 = "order-creation SQL direct, 32 clients (beside the next row)"
	postAlone  = "POST /orders, 32 clients, order service alone (shop order)"
	postAll    = "POST /orders, 32 clients, shop all (whole saga running)"
)

// loadMeasured is what loadgen printed, how busy the machine's CPU was
// meanwhile (%), and the CPU it and the shop took.
type loadMeasured struct {
	loadgenResult
	busy    float64
	cpu     float64 // the machine's busy CPU per order, ms
	shopCPU float64 // the shop process's CPU per order, ms
}

// repeat runs f *runs times and returns its figures.
func repeat(b *testing.B, f func() float64) []float64 {
	b.Helper()
	var out []float64
	for range *runs {
		out = append(out, f())
	}
	return out
}

// measured is a rate and how busy the machine's CPU was meanwhile (%).
type measured struct {
	rate, busy float64
	// cpu and selfCPU are the machine's busy CPU time and this process's
	// own per unit measured (ms), where a row reports them (row 5).
	cpu, selfCPU float64
}

type measuredRuns struct{ rates, busy []float64 }

// repeatMeasured runs f *runs times and returns its figures.
func repeatMeasured(b *testing.B, f func() measured) measuredRuns {
	b.Helper()
	var out measuredRuns
	for range *runs {
		m := f()
		out.rates, out.busy = append(out.rates, m.rate), append(out.busy, m.busy)
	}
	return out
}

// ---- environments ----

type env struct {
	db     *pgtest.Schema
	nats   *natstest.Server
	nc     *nats.Conn
	js     jetstream.JetStream
	stream jetstream.Stream
}

// newEnv makes a schema (with the eventing tables and those of sets) and an embedded JetStream server with the stream EV on ev.>, which
// fsyncs as the tests' servers do (natstest) unless natsOpts say otherwise.
// Everything is released when cleanup runs.
func newEnv(tb testing.TB, sets []migrations.Set, natsOpts ...broker.Option) *env {
	tb.Helper()
	e := &env{db: pgtest.New(tb, sets...), nats: natstest.New(tb, natsOpts...)}
	e.nc, e.js = e.nats.Connect(tb)
	e.stream = e.nats.Stream(tb, e.js, "EV", "ev.>")
	return e
}

// scoped runs f with its own cleanup scope, so each run releases its
// schema, NATS server and processes before the next starts.
func scoped[T any](b *testing.B, f func(tb testing.TB) T) T {
	b.Helper()
	var out T
	// b.Run would add a sub-benchmark line per run; a small TB wrapper
	// with its own cleanups keeps the output to the one table.
	s := &scope{TB: b}
	func() {
		defer s.cleanup()
		out = f(s)
	}()
	return out
}

type scope struct {
	testing.TB
	mu       sync.Mutex
	cleanups []func()
}

func (s *scope) Cleanup(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cleanups = append(s.cleanups, f)
}

func (s *scope) TempDir() string {
	dir, err := os.MkdirTemp("", "benchsuite-")
	if err != nil {
		s.Fatal(err)
	}
	s.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func (s *scope) cleanup() {
	s.mu.Lock()
	cs := s.cleanups
	s.cleanups = nil
	s.mu.Unlock()
	for i := len(cs) - 1; i >= 0; i-- {
		cs[i]()
	}
}

const payloadSize = 1024

var blob = strings.Repeat("x", payloadSize-11)

// fillBacklog commits n pending 1 KiB events, one aggregate per 5 events,
// with UUIDv7 ids, by COPY (as pkg/outbox's benchmarks do), and analyzes
// the outbox.
func fillBacklog(tb testing.TB, pool *pgxpool.Pool, n int, published bool, prefix string) {
	tb.Helper()
	copyBacklog(tb, pool, n, published, prefix)
	if _, err := pool.Exec(context.Background(), `VACUUM ANALYZE outbox`); err != nil {
		tb.Fatal(err)
	}
}

// copyBacklog is fillBacklog's COPY alone, in one transaction.
func copyBacklog(tb testing.TB, pool *pgxpool.Pool, n int, published bool, prefix string) {
	tb.Helper()
	ctx := context.Background()
	payload := `{"blob":"` + blob + `"}`
	cols := []string{"event_id", "aggregate_type", "aggregate_id", "aggregate_seq", "event_type", "schema_version", "subject", "payload"}
	if published {
		payload = `{}` // kept history: small rows, so a million of them load in seconds
		cols = append(cols, "published_at")
	}
	aggregates := max(n/5, 1)
	now := time.Now()
	i := 0
	src := pgx.CopyFromFunc(func() ([]any, error) {
		if i == n {
			return nil, nil
		}
		agg := fmt.Sprint(prefix, i%aggregates)
		row := []any{uuid.Must(uuid.NewV7()), "order", agg, int64(i/aggregates + 1), "Step", int32(1), "ev." + agg + ".Step", payload}
		if published {
			row = append(row, now)
		}
		i++
		return row, nil
	})
	if _, err := pool.CopyFrom(ctx, pgx.Identifier{"outbox"}, cols, src); err != nil {
		tb.Fatal(err)
	}
}

func quietRelay(tb testing.TB, pool *pgxpool.Pool, js jetstream.JetStream, cfg outbox.Config) *outbox.Relay {
	tb.Helper()
	cfg.Logger = quietLogger()
	r, err := outbox.NewRelay(pool, js, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return r
}

// ---- row 1 ----

func jsPublish(b *testing.B, sz sizes) float64 {
	return scoped(b, func(tb testing.TB) float64 {
		e := newEnv(tb, nil)
		payload := []byte(strings.Repeat("x", payloadSize))
		n := sz.jsMsgs
		start := time.Now()
		natstest.PublishAll(tb, e.js, n, func(i int) (*nats.Msg, string) {
			return &nats.Msg{Subject: fmt.Sprintf("ev.p-%d.Raw", i%1000), Data: payload}, uuid.NewString()
		})
		return float64(n) / time.Since(start).Seconds()
	})
}

// orderSQL runs the statements of POST /orders' transaction directly, in
// the real order tables (order.Registration.Sets()), round trip for round
// trip as services/order's create does them (two): BEGIN sent in one batch
// with the key's advisory lock, the key lookup and the catalogue prices;
// then one batch with the order, its one line (loadgen's orders have one)
// and its first history entry, the saga instance and its reservation
// timeout, the OrderCreated event queued through outbox.Writer (sequence
// from the outbox's counter, NOTIFYs coalesced to 5 ms, as the service
// configures it), the stored response, and COMMIT. withOutbox false leaves
// the event out (row 3).
func orderSQL(b *testing.B, sz sizes, clients int, withOutbox bool) measured {
	return scoped(b, func(tb testing.TB) measured {
		e := newEnv(tb, order.Registration.Sets())
		ctx := context.Background()
		pool := e.db.NewPool(tb, int32(clients+2))
		if _, err := pool.Exec(ctx, `INSERT INTO catalogue (sku, price, seq) VALUES ('SKU-1', 250, 1)`); err != nil {
			tb.Fatal(err)
		}
		w := &outbox.Writer{NotifyInterval: 5 * time.Millisecond}
		each := sz.orderTx / clients
		var failed atomic.Int64
		var firstErr atomic.Value
		start, cpu0, self0 := time.Now(), readCPU(), processCPU()
		var wg sync.WaitGroup
		for c := range clients {
			wg.Go(func() {
				for i := range each {
					if err := orderTx(ctx, pool, w, withOutbox, fmt.Sprintf("k-%d-%d", c, i)); err != nil {
						failed.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
				}
			})
		}
		wg.Wait()
		el, cpu1, self1 := time.Since(start), readCPU(), processCPU()
		if failed.Load() > 0 {
			tb.Fatalf("%d order transactions failed: %v", failed.Load(), firstErr.Load())
		}
		n := float64(each * clients)
		return measured{rate: n / el.Seconds(), busy: busyShare(cpu0, cpu1),
			cpu: 1000 * busySeconds(cpu0, cpu1) / n, selfCPU: 1000 * (self1 - self0) / n}
	})
}

func orderTx(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, withOutbox bool, key string) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer func() {
		if conn.Conn().PgConn().TxStatus() != 'I' {
			_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		}
		conn.Release()
	}()
	var locked, found bool
	reads := &pgx.Batch{}
	reads.Queue("BEGIN")
	reads.Queue(`SELECT pg_try_advisory_xact_lock(hashtextextended(current_schema() || '/' || $1, 0))`, key).QueryRow(func(row pgx.Row) error {
		return row.Scan(&locked)
	})
	reads.Queue(`SELECT request_hash, status_code, response, response_normalized, expires_at <= now()
		FROM idempotency_keys WHERE key = $1`, key).
		QueryRow(func(row pgx.Row) error {
			var h, resp []byte
			var st int
			var normalized, expired bool
			err := row.Scan(&h, &st, &resp, &normalized, &expired)
			if err == pgx.ErrNoRows {
				return nil
			}
			found = err == nil
			return err
		})
	reads.Queue(`SELECT sku, price FROM catalogue WHERE sku = ANY($1)`, []string{"SKU-1"}).Query(func(rows pgx.Rows) error {
		var sku string
		var price int64
		_, err := pgx.ForEachRow(rows, []any{&sku, &price}, func() error { return nil })
		return err
	})
	if err := conn.SendBatch(ctx, reads).Close(); err != nil {
		return err
	}
	if !locked || found {
		return fmt.Errorf("key %s: locked %v, found %v; want a fresh key", key, locked, found)
	}
	id := uuid.Must(uuid.NewV7())
	at := time.Now().UTC().Truncate(time.Microsecond)
	body := fmt.Sprintf(`{"order_id":%q,"customer_id":"c-1","status":"PENDING","total":500,"items":[{"sku":"SKU-1","quantity":2,"unit_price":250}],"created_at":%q}`,
		id, at.Format(time.RFC3339Nano))
	writes := &pgx.Batch{}
	writes.Queue(`INSERT INTO orders (order_id, customer_id, status, total, version, created_at, updated_at)
		VALUES ($1, $2, $3, $4, 1, $5, $5)`, id, "c-1", "PENDING", 500, at)
	writes.Queue(`INSERT INTO order_items (order_id, line, sku, quantity, unit_price) VALUES ($1, $2, $3, $4, $5)`, id, 1, "SKU-1", 2, 250)
	writes.Queue(`INSERT INTO order_history (order_id, status, at, reason) VALUES ($1, $2, $3, NULLIF($4, ''))`, id, "PENDING", at, "")
	writes.Queue(`INSERT INTO saga_instances (id, type, state, data) VALUES ($1, $2, $3, $4)`, id.String(), "order", "PENDING", []byte("{}"))
	writes.Queue(`INSERT INTO saga_timeouts (saga_id, name, due_at, trace_headers) VALUES ($1, $2, $3, $4)`,
		id.String(), "reservation", at.Add(5*time.Minute), map[string]string{})
	if withOutbox {
		if err := w.Queue(ctx, writes, outbox.Event{
			AggregateType: "order", AggregateID: id.String(), Type: "OrderCreated",
			Subject: "orders." + id.String() + ".OrderCreated", Payload: []byte(body),
		}); err != nil {
			return err
		}
	}
	writes.Queue(`INSERT INTO idempotency_keys (key, request_hash, status_code, response, order_id, expires_at)
		VALUES ($1, $2, $3, $4, $5, now() + $6::bigint * interval '1 microsecond')`,
		key, []byte("sha256:0123456789abcdef0123456789abcdef"), 201, []byte(body), id, (24 * time.Hour).Microseconds())
	writes.Queue("COMMIT")
	return conn.SendBatch(ctx, writes).Close()
}

// dbOnly measures the relay's database work alone (the relay's own claim
// and mark statements, see readRelayStatements: claim a batch, mark it
// published, publish nothing) over a backlog, from loops concurrent loops:
// one, the plain ceiling; two, as a relay's two workers claim side by side.
func dbOnly(b *testing.B, sz sizes, loops int) measured {
	return scoped(b, func(tb testing.TB) measured {
		e := newEnv(tb, nil)
		fillBacklog(tb, e.db.Pool, sz.backlog, false, "o-")
		pool := e.db.NewPool(tb, int32(loops+2))
		stmts := readRelayStatements(tb)
		ctx := context.Background()
		start, cpu0 := time.Now(), readCPU()
		var done atomic.Int64
		var wg sync.WaitGroup
		for range loops {
			wg.Go(func() {
				for done.Load() < int64(sz.backlog) {
					n, err := stmts.claimAndMark(ctx, pool, "db-only", relayBatch)
					if err != nil {
						tb.Error(err)
						return
					}
					done.Add(int64(n))
				}
			})
		}
		wg.Wait()
		if done.Load() < int64(sz.backlog) {
			tb.Fatalf("DB-only: %d of %d marked", done.Load(), sz.backlog)
		}
		return measured{rate: float64(done.Load()) / time.Since(start).Seconds(), busy: busyShare(cpu0, readCPU())}
	})
}

// ---- rows 2 and 7 ----

// relayDrain drains a backlog of sz.backlog 1 KiB events with n relays of
// the default two workers each, from commit to marked published, into a
// NATS server configured by natsOpts (default: the tests' fsync policy).
func relayDrain(b *testing.B, sz sizes, n int, natsOpts ...broker.Option) measured {
	return scoped(b, func(tb testing.TB) measured {
		e := newEnv(tb, nil, natsOpts...)
		fillBacklog(tb, e.db.Pool, sz.backlog, false, "o-")
		return drain(tb, e, n, sz.backlog)
	})
}

func drain(tb testing.TB, e *env, n, backlog int) measured {
	pool := e.db.NewPool(tb, int32(3*n+2))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	rs := make([]*outbox.Relay, n)
	for i := range rs {
		rs[i] = quietRelay(tb, pool, e.js, outbox.Config{Name: fmt.Sprint("r", i), PollInterval: 5 * time.Millisecond})
	}
	start, cpu0 := time.Now(), readCPU()
	for _, r := range rs {
		wg.Go(func() { _ = r.Run(ctx) })
	}
	deadline := time.Now().Add(5 * time.Minute)
	for {
		var published int64
		for _, r := range rs {
			published += r.Counters().Published
		}
		if published >= int64(backlog) {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("relay drain: %d of %d published after 5 minutes", published, backlog)
		}
		time.Sleep(2 * time.Millisecond)
	}
	el, cpu1 := time.Since(start), readCPU()
	cancel()
	wg.Wait()
	return measured{rate: float64(backlog) / el.Seconds(), busy: busyShare(cpu0, cpu1)}
}

// keptOutbox: the same drain with sz.kept published rows kept in the
// outbox, loaded once; each run adds a fresh backlog.
func keptOutbox(b *testing.B, sz sizes) []float64 {
	return scoped(b, func(tb testing.TB) []float64 {
		e := newEnv(tb, nil)
		fillBacklog(tb, e.db.Pool, sz.kept, true, "old-")
		var out []float64
		for i := range *runs {
			fillBacklog(tb, e.db.Pool, sz.backlog, false, fmt.Sprintf("run%d-", i))
			out = append(out, drain(tb, e, 1, sz.backlog).rate)
		}
		return out
	})
}

// consumerDrain measures an inbox consumer (default 8 workers, a handler
// that does nothing, so only the inbox's own SQL is measured) draining
// sz.consumed messages already in the stream. kept: sz.kept rows of the
// same consumer are in processed_events first; then it runs *runs times
// on one schema (each run adds fresh messages) and returns every figure.
func consumerDrain(b *testing.B, sz sizes, kept bool) measuredRuns {
	return scoped(b, func(tb testing.TB) measuredRuns {
		e := newEnv(tb, nil)
		ctx := context.Background()
		const name = "bench"
		if kept {
			i := 0
			old := time.Now().Add(-time.Hour)
			src := pgx.CopyFromFunc(func() ([]any, error) {
				if i == sz.kept {
					return nil, nil
				}
				i++
				return []any{name, uuid.Must(uuid.NewV7()), old}, nil
			})
			if _, err := e.db.Pool.CopyFrom(ctx, pgx.Identifier{"processed_events"}, []string{"consumer_name", "event_id", "processed_at"}, src); err != nil {
				tb.Fatal(err)
			}
			if _, err := e.db.Pool.Exec(ctx, `VACUUM ANALYZE processed_events`); err != nil {
				tb.Fatal(err)
			}
		}
		n := 1
		if kept {
			n = *runs
		}
		pool := e.db.NewPool(tb, 12)
		var out measuredRuns
		for range n {
			publishEvents(tb, e.js, sz.consumed)
			var processed atomic.Int64
			c, err := inbox.NewConsumer(pool, e.js, inbox.Config{Name: name, Stream: "EV", Logger: quietLogger(),
				Handler: func(_ context.Context, _ pgx.Tx, batch []inbox.Batched) error {
					processed.Add(int64(len(batch)))
					return nil
				}})
			if err != nil {
				tb.Fatal(err)
			}
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			start, cpu0 := time.Now(), readCPU()
			go func() { _ = c.Run(rctx); close(done) }()
			deadline := time.Now().Add(5 * time.Minute)
			for c.Counters().Processed < int64(sz.consumed) {
				if time.Now().After(deadline) {
					cancel()
					tb.Fatalf("consumer: %d of %d after 5 minutes", c.Counters().Processed, sz.consumed)
				}
				time.Sleep(2 * time.Millisecond)
			}
			out.rates = append(out.rates, float64(sz.consumed)/time.Since(start).Seconds())
			out.busy = append(out.busy, busyShare(cpu0, readCPU()))
			cancel()
			<-done
		}
		return out
	})
}

// publishEvents puts n events in the stream as the relay would send them:
// each its own aggregate, sequence 1, every contract header.
func publishEvents(tb testing.TB, js jetstream.JetStream, n int) {
	tb.Helper()
	payload := []byte(`{"blob":"` + blob + `"}`)
	occurred := time.Now().UTC().Format(time.RFC3339Nano)
	natstest.PublishAll(tb, js, n, func(int) (*nats.Msg, string) {
		id := uuid.Must(uuid.NewV7())
		agg := id.String()
		h := nats.Header{}
		h.Set("Event-Type", "Step")
		h.Set("Aggregate-Type", "order")
		h.Set("Aggregate-Id", agg)
		h.Set("Aggregate-Seq", "1")
		h.Set("Schema-Version", "1")
		h.Set("Occurred-At", occurred)
		return &nats.Msg{Subject: "ev." + agg + ".Step", Header: h, Data: payload}, id.String()
	})
}

// ---- row 4 ----

// goid is the current goroutine's id: the inbox calls its after-commit
// failpoint on the goroutine that ran the handler, which is how an event
// id seen in the handler is matched with the moment its transaction
// committed, with no hook added to the library.
func goid() uint64 {
	var buf [32]byte
	n := runtime.Stack(buf[:], false)
	s := strings.TrimPrefix(string(buf[:n]), "goroutine ")
	var id uint64
	for _, c := range s {
		if c < '0' || c > '9' {
			break
		}
		id = id*10 + uint64(c-'0')
	}
	return id
}

// latency writes 500 events/s for sz.latencySecs seconds, one 1 KiB event
// per transaction, and measures commit → stored by the stream (a core
// subscriber sees each message as JetStream stores it, just before the
// PubAck goes out) and commit → the consumer's transaction committed.
// wake: the relay is woken by NOTIFY, which the writer sends at most once
// per notify (5 ms as the services' writers; 0: on every commit);
// otherwise it polls every 100 ms with no LISTEN and no NOTIFY. batch is
// the consumer's BatchSize (0: the inbox default). mode is the relay's: in
// ModeCDC the events are written once the relay streams its slot (row 12).
func latency(b *testing.B, sz sizes, wake bool, notify time.Duration, batch int, mode outbox.Mode) latencies {
	return scoped(b, func(tb testing.TB) latencies {
		e := newEnv(tb, nil)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var mu sync.Mutex
		committed := map[string]time.Time{}
		var ackLat, consLat []time.Duration
		nc, _ := e.nats.Connect(tb)
		sub, err := nc.Subscribe("ev.>", func(m *nats.Msg) {
			at := time.Now()
			mu.Lock()
			defer mu.Unlock()
			if c, ok := committed[m.Header.Get("Nats-Msg-Id")]; ok {
				ackLat = append(ackLat, at.Sub(c))
			}
		})
		if err != nil {
			tb.Fatal(err)
		}
		defer sub.Unsubscribe()
		// goroutine id → the event ids its worker handled since its last
		// commit: a worker may commit several deliveries at once (a batch).
		var inHandler sync.Map
		pool := e.db.NewPool(tb, 12)
		c, err := inbox.NewConsumer(pool, e.js, inbox.Config{Name: "lat", Stream: "EV", Logger: quietLogger(), BatchSize: batch,
			Handler: inbox.Each(func(_ context.Context, _ pgx.Tx, m inbox.Message) error {
				ids, _ := inHandler.Load(goid())
				list, _ := ids.([]string)
				inHandler.Store(goid(), append(list, m.EventID.String()))
				return nil
			}),
			Hooks: inbox.Hooks{FailpointFunc: func(name string) error {
				if name != failpoint.InboxAfterCommitBeforeAck {
					return nil
				}
				at := time.Now()
				if ids, ok := inHandler.LoadAndDelete(goid()); ok {
					mu.Lock()
					for _, id := range ids.([]string) {
						if c, ok := committed[id]; ok {
							consLat = append(consLat, at.Sub(c))
						}
					}
					mu.Unlock()
				}
				return nil
			}}})
		if err != nil {
			tb.Fatal(err)
		}
		cfg := outbox.Config{}
		w := &outbox.Writer{NotifyInterval: notify}
		if !wake {
			cfg = outbox.Config{PollInterval: 100 * time.Millisecond, DisableListen: true}
			w = &outbox.Writer{NotifyInterval: 1000 * time.Hour} // one NOTIFY at first, which nobody hears
		}
		cfg.Mode = mode
		r := quietRelay(tb, e.db.Pool, e.js, cfg)
		if mode == outbox.ModeCDC {
			// Runs after the relay has stopped (wg.Wait below) and before
			// the schema is dropped: a slot left behind pins WAL.
			tb.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				if slot := r.State().Slot; slot != "" {
					if err := outbox.DropSlot(ctx, e.db.Pool, slot); err != nil {
						tb.Error(err)
					}
				}
			})
		}
		var wg sync.WaitGroup
		wg.Go(func() { _ = r.Run(ctx) })
		wg.Go(func() { _ = c.Run(ctx) })
		defer wg.Wait()
		defer cancel()
		time.Sleep(300 * time.Millisecond) // LISTEN and the consumer in place
		for deadline := time.Now().Add(time.Minute); mode == outbox.ModeCDC && !r.State().Streaming; {
			if st := r.State(); st.CDCUnavailable != "" || time.Now().After(deadline) {
				tb.Fatalf("the CDC relay does not stream: %+v", st)
			}
			time.Sleep(2 * time.Millisecond)
		}
		const rate = 500
		payload := []byte(`{"blob":"` + blob + `"}`)
		tick := time.NewTicker(time.Second / rate)
		total := rate * sz.latencySecs
		// The first half second is not measured: the first events of a
		// fresh process meet cold paths (new pool connections, statements
		// not yet prepared, the consumer's first pulls) and took up to
		// 150 ms each, which in a 5 s run was the whole p99.
		warmUp := rate / 2
		var cpu0 cpuSample
		for i := range warmUp + total {
			<-tick.C
			if i == warmUp {
				cpu0 = readCPU()
			}
			id := uuid.Must(uuid.NewV7())
			ev := outbox.Event{ID: id, AggregateType: "order", AggregateID: id.String(), Seq: 1, Type: "Step",
				Subject: "ev." + id.String() + ".Step", Payload: payload}
			if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error { return w.Add(ctx, tx, ev) }); err != nil {
				tb.Fatal(err)
			}
			if i < warmUp {
				continue
			}
			now := time.Now()
			mu.Lock()
			committed[id.String()] = now
			mu.Unlock()
		}
		tick.Stop()
		busy := busyShare(cpu0, readCPU())
		deadline := time.Now().Add(10 * time.Second)
		for {
			mu.Lock()
			n := len(consLat)
			mu.Unlock()
			if n >= total || time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(ackLat) < total*9/10 || len(consLat) < total*9/10 {
			tb.Fatalf("saw %d stored and %d consumed of %d events", len(ackLat), len(consLat), total)
		}
		return latencies{quantiles(ackLat), quantiles(consLat), busy}
	})
}

// latencies are the p50, p99 and max in ms of commit → stored and commit
// → consumer commit, and how busy the machine's CPU was (%) while the
// events were written.
type latencies struct {
	ack, cons [3]float64
	busy      float64
}

func quantiles(d []time.Duration) [3]float64 {
	slices.Sort(d)
	ms := func(x time.Duration) float64 { return float64(x.Microseconds()) / 1000 }
	q := func(p float64) float64 { return ms(d[int(p*float64(len(d)-1))]) }
	return [3]float64{q(0.5), q(0.99), ms(d[len(d)-1])}
}
