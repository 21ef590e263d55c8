//go:build shopbench

package benchsuite

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services"
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// shopBinary builds cmd/shop once per test binary, into a temp dir, with
// the services.All this test binary has.
func shopBinary(tb testing.TB) string {
	tb.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "benchsuite-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "shop")
		out, err := exec.Command("go", "build", "-tags", services.BuildTags, "-o", binPath, "github.com/shop-ref/shop/cmd/shop").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		tb.Fatal(buildErr)
	}
	return binPath
}

// shop is one `shop all` child process on a database of its own.
type shop struct {
	tb      testing.TB
	bin     string
	dir     string
	db      pgtest.Database
	env     []string // extra environment of the shop's commands
	nats    string   // NATS_URL given in env; empty: the shop's embedded server
	admin   *pgxpool.Pool
	cmd     *exec.Cmd
	exited  chan struct{}
	addrs   map[string]string
	stopped bool
}

func freeAddr(tb testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// startShop creates a throwaway database, migrates it with `shop migrate`,
// starts `shop all` (embedded NATS in its own temp dir, services on free
// 127.0.0.1 ports, FULFILLMENT_DELAY 10ms, plus env), waits until every
// service is ready and stocks SKU-1 to SKU-16.
func startShop(tb testing.TB, tag string, env ...string) *shop {
	tb.Helper()
	s := newShop(tb, tag, env...)
	s.launch("all", services.All.Names()...)
	client := &http.Client{Timeout: 5 * time.Second}
	// Stock, then wait until the order service has the catalogue entries.
	for k := 1; k <= 16; k++ {
		req, _ := http.NewRequest(http.MethodPut, fmt.Sprintf("%s/stock/SKU-%d", s.url("inventory"), k), strings.NewReader(`{"on_hand":100000000,"price":250}`))
		req.Header.Set("Content-Type", "application/json")
		res, err := client.Do(req)
		if err != nil {
			tb.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			tb.Fatalf("stock SKU-%d: %s", k, res.Status)
		}
	}
	s.waitOrderable(client)
	return s
}

// startOrderAlone is startShop with the order service alone (`shop order`:
// its HTTP API, its relay, its idle consumers and timeout scanner), on a
// NATS server in the benchmark process, with nothing else consuming what
// it publishes. Its catalogue (SKU-1 to SKU-16 at 250) is written straight
// into its table, as inventory's ProductUpdated would have. Shedding is
// off and the reservation timeout far away: nothing but POST /orders and
// the relay's publishing of OrderCreated runs in it.
func startOrderAlone(tb testing.TB, tag string) *shop {
	tb.Helper()
	s := newShop(tb, tag, "NATS_URL="+natstest.New(tb).URL(), "ORDER_MAX_BACKLOG=0", "ORDER_RESERVATION_TIMEOUT=1h")
	s.launch("order", "order")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := s.admin.Exec(ctx, `INSERT INTO orders.catalogue (sku, price, seq)
		SELECT 'SKU-' || k, 250, 1 FROM generate_series(1, 16) AS k`); err != nil {
		tb.Fatal(err)
	}
	s.waitOrderable(&http.Client{Timeout: 5 * time.Second})
	return s
}

// newShop creates a throwaway database and migrates it with `shop migrate`;
// launch starts the shop on it.
func newShop(tb testing.TB, tag string, env ...string) *shop {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s := &shop{tb: tb, bin: shopBinary(tb), addrs: map[string]string{}, env: env}
	for _, kv := range env {
		if url, ok := strings.CutPrefix(kv, "NATS_URL="); ok {
			s.nats = url
		}
	}
	var err error
	if s.dir, err = os.MkdirTemp("", "benchsuite-shop-"); err != nil {
		tb.Fatal(err)
	}
	// Dropped by stop, after the process: not pgtest.NewDatabase, since
	// row 5 stops its shop before the benchmark ends.
	if s.db, err = pgtest.CreateDatabase(ctx, "shop_bench_"+tag+"_"); err != nil {
		tb.Fatal(err)
	}
	if out, err := s.command("migrate").CombinedOutput(); err != nil {
		s.dropDB()
		tb.Fatalf("shop migrate: %v\n%s", err, out)
	}
	if s.admin, err = database.NewPool(ctx, s.db.URL, "public", 4); err != nil {
		s.dropDB()
		tb.Fatal(err)
	}
	tb.Cleanup(s.stop)
	// Every service gets an address, running or not: loadgen is given
	// the payment service's even when it will not call it.
	for _, svc := range services.All.Names() {
		s.addrs[svc] = freeAddr(s.tb)
	}
	return s
}

// launch starts `shop <command>` and waits until the services named are
// ready.
func (s *shop) launch(command string, ready ...string) {
	tb := s.tb
	tb.Helper()
	s.cmd = s.command(command)
	logf, err := os.Create(filepath.Join(s.dir, "shop.log"))
	if err != nil {
		tb.Fatal(err)
	}
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	if err := s.cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	s.exited = make(chan struct{})
	go func() { _ = s.cmd.Wait(); logf.Close(); close(s.exited) }()
	client := &http.Client{Timeout: 5 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, svc := range ready {
		if err := httpx.WaitReady(ctx, client, s.url(svc)); err != nil {
			tb.Fatalf("%s service: %v; log in %s", svc, err, s.dir)
		}
	}
}

// waitOrderable waits until the order service creates an order of
// SKU-16, the last one stocked.
func (s *shop) waitOrderable(client *http.Client) {
	tb := s.tb
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for k := 0; ; k++ {
		req, _ := http.NewRequest(http.MethodPost, s.url("order")+"/orders",
			strings.NewReader(`{"customer_id":"probe","items":[{"sku":"SKU-16","quantity":1}]}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", fmt.Sprintf("probe-%d", k))
		res, err := client.Do(req)
		if err == nil {
			res.Body.Close()
			if res.StatusCode == http.StatusCreated {
				return
			}
		}
		if time.Now().After(deadline) {
			tb.Fatalf("the order service never learned SKU-16; log in %s", s.dir)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (s *shop) url(svc string) string { return "http://" + s.addrs[svc] }

func (s *shop) command(args ...string) *exec.Cmd {
	cmd := exec.Command(s.bin, args...)
	cmd.Dir = s.dir
	cmd.Env = []string{
		"DATABASE_URL=" + s.db.URL,
		"PAYMENT_WEBHOOK_SECRET=bench-secret",
		"PAYMENT_FAKE_PROVIDER=true", // the saga row pays through /simulate
		"FULFILLMENT_DELAY=10ms",
		"DASHBOARD_ADDR=127.0.0.1:0",
	}
	cmd.Env = append(cmd.Env, s.env...)
	for svc, a := range s.addrs {
		cmd.Env = append(cmd.Env, strings.ToUpper(svc)+"_ADDR="+a)
	}
	for _, k := range []string{"PATH", "HOME", "TMPDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
	}
	return cmd
}

// cpuSeconds is the user and system CPU the shop process has used so far,
// from /proc/<pid>/stat (utime and stime, fields 14 and 15, counted after
// the command name, which may hold spaces).
func (s *shop) cpuSeconds() float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", s.cmd.Process.Pid))
	if err != nil {
		s.tb.Fatal(err)
	}
	_, after, _ := bytes.Cut(b, []byte(") "))
	f := strings.Fields(string(after)) // f[0] is field 3, the state
	if len(f) < 13 {
		s.tb.Fatalf("/proc/%d/stat: %q", s.cmd.Process.Pid, b)
	}
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	return (utime + stime) / ticksPerSecond
}

// peakRSSMB reads VmHWM of the shop process.
func (s *shop) peakRSSMB() float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		s.tb.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	s.tb.Fatal("no VmHWM in /proc status")
	return 0
}

// stop stops the process it started, by its pid: SIGINT, then SIGKILL
// after 20 s; then drops the database.
func (s *shop) stop() {
	if s.stopped {
		return
	}
	s.stopped = true
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-s.exited:
		case <-time.After(20 * time.Second):
			_ = s.cmd.Process.Kill()
			<-s.exited
		}
	}
	if s.admin != nil {
		// A shop in ModeCDC leaves its slots (they are its position), and
		// DROP DATABASE refuses a database that has any.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if _, err := s.admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
			WHERE database = current_database() AND NOT active`); err != nil {
			s.tb.Error(err)
		}
		cancel()
		s.admin.Close()
	}
	s.dropDB()
	// A failed run's messages name its log: keep it, or they point at
	// nothing.
	if *keepLogs || s.tb.Failed() {
		s.tb.Logf("shop log kept in %s", s.dir)
		return
	}
	os.RemoveAll(s.dir)
}

var keepLogs = flag.Bool("suite.keep-logs", false, "keep the shop processes' logs")

func (s *shop) dropDB() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.db.Drop(ctx); err != nil {
		s.tb.Error(err)
	}
}

// loadgenResult is what `shop loadgen` printed.
type loadgenResult struct {
	createRate, createP50, createP99 float64 // orders/s, ms
	loadgenCPU                       float64 // the loadgen process's user and system CPU, seconds
	completed                        int
	doneP50, doneP99                 float64 // ms
	out                              string
}

var (
	reCreation = regexp.MustCompile(`creation:\s+\d+ in \S+ = ([0-9.]+) orders/s`)
	reCreLat   = regexp.MustCompile(`creation latency:\s+p50 (\S+)\s+p90 \S+\s+p99 (\S+)`)
	reDone     = regexp.MustCompile(`order→COMPLETED:\s+(\d+) completed\s+p50 (\S+)\s+p99 (\S+)`)
)

func ms(s string) float64 {
	d, err := time.ParseDuration(s)
	if err != nil {
		return -1
	}
	return float64(d.Microseconds()) / 1000
}

// loadgen runs `shop loadgen` (the built binary) against s and parses its
// report.
func (s *shop) loadgen(tb testing.TB, args ...string) loadgenResult {
	tb.Helper()
	r, err := s.runLoadgen(args...)
	if err != nil {
		tb.Fatal(err)
	}
	return r
}

func (s *shop) runLoadgen(args ...string) (loadgenResult, error) {
	args = append([]string{"loadgen", "-order-url", s.url("order"), "-payment-url", s.url("payment")}, args...)
	cmd := exec.Command(s.bin, args...)
	cmd.Dir = s.dir
	out, err := cmd.CombinedOutput()
	r := loadgenResult{out: string(out)}
	if ps := cmd.ProcessState; ps != nil {
		r.loadgenCPU = (ps.UserTime() + ps.SystemTime()).Seconds()
	}
	if err != nil {
		return r, fmt.Errorf("shop loadgen: %v\n%s", err, out)
	}
	if m := reCreation.FindStringSubmatch(r.out); m != nil {
		r.createRate, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := reCreLat.FindStringSubmatch(r.out); m != nil {
		r.createP50, r.createP99 = ms(m[1]), ms(m[2])
	}
	if m := reDone.FindStringSubmatch(r.out); m != nil {
		r.completed, _ = strconv.Atoi(m[1])
		r.doneP50, r.doneP99 = ms(m[2]), ms(m[3])
	}
	return r, nil
}

// ---- rows 6 and 8 ----

type sagaResult struct {
	rate, p99, backlog, oldest, unpublished, rssMB float64
	shed                                           float64 // POST /orders refused with 503 (admission control)
	txPerOrder                                     float64 // committed transactions in the shop's database per completed order
	busy                                           float64 // machine CPU busy over the measured window, %
	cpuPerOrder                                    float64 // machine CPU (all cores, everything on it) per order completed in the window, ms
	completed                                      int     // orders COMPLETED by the end of the run, in the window or after it
	slots                                          float64 // replication slots of the shop's database at the end of the load (row 13)
}

// saga starts a fresh `shop all` (with its embedded NATS server, or with
// natsOpts a NATS server in the benchmark process configured by them) and
// offers *sagaRate orders/s for
// *sagaSeconds from 32 concurrent clients over HTTP (POST /orders, 16 SKUs
// in turn). The driver learns where each order is from the broker instead
// of polling GET /orders (a core subscription to orders.> on the shop's
// embedded NATS): on OrderAwaitingPayment it pays at once through POST
// /payments/{id}/simulate, on OrderCompleted the saga is done. It measures
// the sustained COMPLETED rate over the last three quarters of the window,
// order → COMPLETED p99, the backlog when the offered load ends, and the
// process's peak RSS (VmHWM).
func saga(b *testing.B, sz sizes, natsOpts ...broker.Option) sagaResult {
	return sagaWith(b, sz, nil, natsOpts...)
}

// sagaWith is saga with extra environment for the shop process.
func sagaWith(b *testing.B, sz sizes, extraEnv []string, natsOpts ...broker.Option) sagaResult {
	return scoped(b, func(tb testing.TB) sagaResult {
		env := slices.Clone(extraEnv)
		if len(natsOpts) > 0 {
			env = append(env, "NATS_URL="+natstest.New(tb, natsOpts...).URL())
		}
		s := startShop(tb, "saga", env...)
		secs := *sagaSeconds
		if *quick {
			secs = 4
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		nc := s.auditConn(tb)
		defer nc.Close()
		client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 128}}
		post := func(url, key, body string) (int, []byte, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if key != "" {
				req.Header.Set("Idempotency-Key", key)
			}
			res, err := client.Do(req)
			if err != nil {
				return 0, nil, err
			}
			defer res.Body.Close()
			b, err := io.ReadAll(res.Body)
			return res.StatusCode, b, err
		}

		var mu sync.Mutex
		created := map[string]time.Time{}
		completedAt := map[string]time.Time{}
		var paid sync.Map
		payQ := make(chan string, 1<<16)
		// The order events, read as the audit user reads a stream: by
		// direct get, from now on (it may create no consumer, and the
		// shop's users may not subscribe to another's subjects), a batch
		// per round trip. Read a message per round trip, the reader fell
		// thousands of messages behind at 250 orders/s offered: payments
		// and completions were seen late, and the row measured the reader.
		js, err := jetstream.New(nc)
		if err != nil {
			tb.Fatal(err)
		}
		orders, err := js.Stream(ctx, "ORDERS")
		if err != nil {
			tb.Fatal(err)
		}
		onEvent := func(subject string) {
			parts := strings.Split(subject, ".")
			if len(parts) != 3 {
				return
			}
			switch parts[2] {
			case "OrderAwaitingPayment":
				if _, dup := paid.LoadOrStore(parts[1], true); !dup {
					payQ <- parts[1]
				}
			case "OrderCompleted":
				now := time.Now()
				mu.Lock()
				if _, ok := completedAt[parts[1]]; !ok {
					completedAt[parts[1]] = now
				}
				mu.Unlock()
			}
		}
		readCtx, stopReading := context.WithCancel(ctx)
		read := make(chan struct{})
		var readTo atomic.Uint64 // the last sequence the reader has handled
		go func() {
			defer close(read)
			next := orders.CachedInfo().State.LastSeq + 1
			for readCtx.Err() == nil {
				more, err := broker.DirectGetBatch(readCtx, nc, jetstream.DefaultAPIPrefix, "ORDERS",
					broker.DirectGetRequest{Seq: next, NextFor: ">", Batch: 512},
					func(seq uint64, h nats.Header) bool {
						onEvent(h.Get(jetstream.SubjectHeader))
						readTo.Store(seq)
						next = seq + 1
						return true
					})
				if err != nil || !more { // caught up (or the broker busy): look again shortly
					time.Sleep(2 * time.Millisecond)
				}
			}
		}()
		defer func() { stopReading(); <-read }()
		var errs, shed atomic.Int64
		var firstErr atomic.Value
		noteErr := func(err error) {
			errs.Add(1)
			firstErr.CompareAndSwap(nil, err.Error())
		}
		var wg sync.WaitGroup
		defer wg.Wait()
		defer cancel()
		for range 16 { // payers: an order that says WAIT_PAY takes its payment at once
			wg.Go(func() {
				for {
					var id string
					select {
					case id = <-payQ:
					case <-ctx.Done():
						return
					}
					for try := 0; ctx.Err() == nil; try++ {
						st, body, err := post(s.url("payment")+"/payments/"+id+"/simulate", "", `{"outcome":"succeeded"}`)
						if err == nil && (st == http.StatusOK || st == http.StatusAccepted) {
							break
						}
						if err == nil && st < 500 {
							noteErr(fmt.Errorf("simulate %s the moment it said WAIT_PAY: %d %s", id, st, body))
							break
						}
						time.Sleep(20 * time.Millisecond)
					}
				}
			})
		}

		xacts := func() (n int64) {
			if err := s.admin.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n); err != nil {
				tb.Error(err)
			}
			return n
		}
		x0 := xacts()
		start := time.Now()
		window := time.Duration(secs) * time.Second
		cpuFrom := make(chan cpuSample, 1) // the CPU reading where the measured window starts
		time.AfterFunc(window/4, func() { cpuFrom <- readCPU() })
		jobs := make(chan int)
		go func() {
			defer close(jobs)
			tick := time.NewTicker(time.Duration(float64(time.Second) / *sagaRate))
			defer tick.Stop()
			for i := 0; time.Since(start) < window; i++ {
				select {
				case jobs <- i:
				case <-ctx.Done():
					return
				}
				<-tick.C
			}
		}()
		var creators sync.WaitGroup
		for range 32 {
			creators.Go(func() {
				for i := range jobs {
					body := fmt.Sprintf(`{"customer_id":"bench-%d","items":[{"sku":"SKU-%d","quantity":1}]}`, i%100, i%16+1)
					t0 := time.Now()
					st, resp, err := post(s.url("order")+"/orders", fmt.Sprint("saga-", i), body)
					if err == nil && st == http.StatusServiceUnavailable {
						shed.Add(1) // refused by admission control: offered, not taken
						continue
					}
					if err != nil || st != http.StatusCreated {
						noteErr(fmt.Errorf("POST /orders: %d %s %v", st, resp, err))
						continue
					}
					var o struct {
						OrderID string `json:"order_id"`
					}
					if err := json.Unmarshal(resp, &o); err != nil {
						noteErr(err)
						continue
					}
					mu.Lock()
					created[o.OrderID] = t0
					mu.Unlock()
				}
			})
		}
		creators.Wait()
		end, cpuEnd := time.Now(), readCPU()
		var res sagaResult
		var oldest float64
		var backlog int64
		if err := s.admin.QueryRow(ctx, `SELECT count(*), coalesce(extract(epoch FROM max(now() - created_at)) * 1000, 0)::float8 FROM orders.orders
			WHERE status NOT IN ('COMPLETED', 'CLOSED', 'REJECTED') AND customer_id <> 'probe'`).Scan(&backlog, &oldest); err != nil {
			tb.Error(err)
		}
		res.backlog, res.oldest = float64(backlog), oldest
		var slots int64
		if err := s.admin.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database = current_database()`).Scan(&slots); err != nil {
			tb.Error(err)
		}
		res.slots = float64(slots)
		res.shed = float64(shed.Load())
		var states string // where the unended orders wait, for the log
		if err := s.admin.QueryRow(ctx, `SELECT coalesce(string_agg(status || ' ' || n, ', ' ORDER BY status), '')
			FROM (SELECT status, count(*) AS n FROM orders.orders GROUP BY status) c`).Scan(&states); err != nil {
			tb.Error(err)
		}
		var behind uint64
		if info, err := orders.Info(ctx); err == nil {
			behind = info.State.LastSeq - min(readTo.Load(), info.State.LastSeq)
		}
		tb.Logf("saga run: orders by state at the end of the load: %s; %d shed; unsettled messages by consumer: %s; the driver's reader %d ORDERS messages behind",
			states, shed.Load(), consumerBacklog(ctx, nc), behind)
		for _, e := range services.All {
			var n int64
			if err := s.admin.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{e.Schema, "outbox"}.Sanitize()+` WHERE published_at IS NULL`).Scan(&n); err != nil {
				tb.Error(err)
			}
			res.unpublished += float64(n)
		}
		// Let the rest finish (bounded), for the latency of every order.
		deadline := time.Now().Add(15 * time.Second)
		for time.Now().Before(deadline) {
			mu.Lock()
			n, m := len(completedAt), len(created)
			mu.Unlock()
			if n >= m {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		res.rssMB = s.peakRSSMB()
		x1 := xacts()
		mu.Lock()
		from := start.Add(window / 4)
		var inWindow, nDone int
		var lat []time.Duration
		for id, at := range completedAt {
			c, ok := created[id]
			if !ok {
				continue // startShop's probe order, which the payers paid too
			}
			nDone++
			if !at.Before(from) && !at.After(end) {
				inWindow++
			}
			lat = append(lat, at.Sub(c))
		}
		nCreated := len(created)
		mu.Unlock()
		res.rate = float64(inWindow) / end.Sub(from).Seconds()
		if c0 := <-cpuFrom; inWindow > 0 {
			res.busy = busyShare(c0, cpuEnd)
			res.cpuPerOrder = 1000 * busySeconds(c0, cpuEnd) / float64(inWindow)
		}
		res.completed = nDone
		res.txPerOrder = float64(x1-x0) / float64(max(nDone, 1))
		tb.Logf("saga run: transactions per completed order by step: %s", stepTransactions(ctx, s.admin, nDone))
		if len(lat) > 0 {
			res.p99 = quantiles(lat)[1]
		}
		if e := errs.Load(); e > 0 {
			tb.Logf("saga run: %d errors, first: %v", e, firstErr.Load())
		}
		if *quick || nDone < nCreated {
			tb.Logf("saga run: %d orders created in %v, %d completed; log in %s", nCreated, end.Sub(start).Round(time.Millisecond), nDone, s.dir)
		}
		return res
	})
}

// skuList is the SKUs startShop stocks, as a loadgen -sku value.
var skuList = func() string {
	skus := make([]string, 16)
	for i := range skus {
		skus[i] = fmt.Sprintf("SKU-%d", i+1)
	}
	return strings.Join(skus, ",")
}()

// waitIdle waits until no order is PENDING and every outbox is published,
// for at most limit.
func (s *shop) waitIdle(tb testing.TB, limit time.Duration) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	for {
		var busy int64
		err := s.admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders.orders WHERE status = 'PENDING')
			+ (SELECT count(*) FROM orders.outbox WHERE published_at IS NULL)
			+ (SELECT count(*) FROM inventory.outbox WHERE published_at IS NULL)`).Scan(&busy)
		if err == nil && busy == 0 {
			return
		}
		select {
		case <-ctx.Done():
			tb.Logf("the shop did not become idle within %v (%d still busy, err %v)", limit, busy, err)
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

var reNATS = regexp.MustCompile(`embedded nats started"? url=(\S+)`)

// auditConn connects to the shop's NATS server as the audit user, with
// the password its embedded server left in its directory (a server given
// in NATS_URL is the benchmark's own, open to anyone).
func (s *shop) auditConn(tb testing.TB) *nats.Conn {
	var opts []nats.Option
	if s.nats == "" {
		b, err := os.ReadFile(filepath.Join(s.dir, app.DemoAuditPasswordFile))
		if err != nil {
			tb.Fatalf("the audit password of the shop's embedded NATS server: %v", err)
		}
		opts = broker.UserOptions(broker.AuditUser, strings.TrimSpace(string(b)))
	}
	nc, err := nats.Connect(s.natsURL(tb), opts...)
	if err != nil {
		tb.Fatal(err)
	}
	return nc
}

// natsURL is the URL of the shop's NATS server: the one it was given, or
// its embedded server's, read from its log.
func (s *shop) natsURL(tb testing.TB) string {
	if s.nats != "" {
		return s.nats
	}
	b, err := os.ReadFile(filepath.Join(s.dir, "shop.log"))
	if err != nil {
		tb.Fatal(err)
	}
	m := reNATS.FindSubmatch(b)
	if m == nil {
		tb.Fatalf("no embedded nats URL in %s/shop.log", s.dir)
	}
	return string(m[1])
}

// consumerBacklog names each consumer of the shop's streams with the
// messages it has not settled (pending + ack pending): where the saga queues.
func consumerBacklog(ctx context.Context, nc *nats.Conn) string {
	js, err := jetstream.New(nc)
	if err != nil {
		return err.Error()
	}
	var parts []string
	for _, e := range services.All {
		name := e.Stream
		st, err := js.Stream(ctx, name)
		if err != nil {
			parts = append(parts, name+": "+err.Error())
			continue
		}
		list := st.ListConsumers(ctx)
		for info := range list.Info() {
			parts = append(parts, fmt.Sprintf("%s %d", info.Name, info.NumPending+uint64(max(info.NumAckPending, 0))))
		}
	}
	return strings.Join(parts, ", ")
}

// stepTransactions counts, per completed order, the transactions of each
// step that leave rows behind, by the distinct xmin of those rows (the
// transaction that last wrote each): each consumer's (processed_events),
// each service's outbox rows (published: the relay's mark; the claim before
// it, as many again, is not seen). Not a wall-clock figure, and untouched
// by transactions that write nothing (reads, empty claims), which
// xact_commit counts too; but a consumer that lags applies bigger batches,
// so the counts fall as the load rises.
func stepTransactions(ctx context.Context, db *pgxpool.Pool, orders int) string {
	var parts []string
	count := func(label, sql string, args ...any) {
		var n int64
		if err := db.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			parts = append(parts, label+" "+err.Error())
			return
		}
		parts = append(parts, fmt.Sprintf("%s %.2f", label, float64(n)/float64(max(orders, 1))))
	}
	for _, e := range services.All {
		schema := pgx.Identifier{e.Schema}.Sanitize()
		for _, c := range e.Consumers {
			count(c.Name, `SELECT count(DISTINCT xmin::text) FROM `+schema+`.processed_events WHERE consumer_name = $1`, c.Name)
		}
		count(e.Name+" relay marks", `SELECT count(DISTINCT xmin::text) FROM `+schema+`.outbox WHERE published_at IS NOT NULL`)
	}
	return strings.Join(parts, ", ")
}
