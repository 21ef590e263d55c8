// Package chaos is the chaos run of the shop (`make chaos`): it builds the
// real `shop` binary, starts two copies of every service as separate
// processes against a throwaway Postgres database and a NATS server it
// controls, drives orders through the public HTTP API, and meanwhile
// SIGKILLs processes, fires every failpoint, stops the broker and cuts one
// service's database connections. Then it restarts everything cleanly,
// waits until every saga has ended and checks the contract's invariants
// with the code of `shop verify`.
package chaos

import (
	"bufio"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	mrand "math/rand/v2"
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
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/natstest"
	"github.com/shop-ref/shop/internal/pgtest"
	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/migrations"
)

// Config sizes a run.
type Config struct {
	Duration time.Duration // how long the chaos lasts (at least RetentionWait)
	Rate     float64       // orders started per second while it lasts
	Copies   int           // processes per service (at least 2)
	Out      io.Writer     // the table and progress lines
}

const (
	paymentTimeout = 3 * time.Second
	webhookSecret  = "chaos-secret"
	operatorToken  = "chaos-operator-token"
	// fillerEvents old published rows are put in fulfillment's outbox so
	// that its retention deletes more than one batch (1000) and passes the
	// outbox.retention_mid_batch failpoint. Retention runs once a minute.
	fillerEvents = 2500
	// RetentionWait is how long a relay waits before its first retention
	// run: the shortest chaos phase that can fire outbox.retention_mid_batch.
	RetentionWait = time.Minute
)

// plan says where each failpoint is armed and on which hit it crashes.
// A failpoint missing here is armed on an order process at its first hit,
// and the run fails if that never fires.
var plan = map[string]struct {
	service string
	count   int
}{
	failpoint.OrderAfterCommitBeforeResponse:          {"order", 3},
	failpoint.SagaAfterClaimTimeout:                   {"order", 1},
	failpoint.OutboxAfterClaim:                        {"order", 4},
	failpoint.InboxBeforeCommit:                       {"inventory", 6},
	failpoint.OutboxBeforePublish:                     {"inventory", 5},
	failpoint.InboxAfterCommitBeforeAck:               {"payment", 3},
	failpoint.OutboxAfterAckBeforeMark:                {"inventory", 3},
	failpoint.PaymentWebhookAfterCommitBeforeResponse: {"payment", 2},
	failpoint.PaymentRefundAfterProviderBeforeStore:   {"payment", 1},
	failpoint.OutboxRetentionMidBatch:                 {"fulfillment", 1}, // armed on every copy
}

var firedLine = regexp.MustCompile(`failpoint (\S+): crash \(hit`)

// Result is what a run saw.
type Result struct {
	Orders          int
	Scenarios       []ScenarioResult
	EventsPublished int64
	Duplicates      int64
	Killed          int64
	Crashes         int64 // exits by a failpoint
	Fired           map[string]int
	NotFired        []string
	Terminated      int64 // database backends terminated
	NATSOutage      time.Duration
	Violations      int
	Report          verify.Report
	Unended         int // orders whose saga had not ended by the deadline
	Elapsed         time.Duration
}

// ScenarioResult counts one kind of order by final status.
type ScenarioResult struct {
	Name   string
	Orders int
	Final  map[string]int
}

// ---- processes ----

type fpJob struct{ name, spec string }

// slot is one service copy: a supervisor restarts its process whenever it
// exits, armed with the next failpoint of its queue while chaos is on.
type slot struct {
	h       *harness
	name    string // order-1
	service string
	addr    string

	mu      sync.Mutex
	cmd     *exec.Cmd
	gen     int
	spec    fpJob // armed in the running process
	queue   []fpJob
	stop    bool
	exited  chan struct{}
	running bool
}

type harness struct {
	t      testing.TB
	cfg    Config
	bin    string
	logDir string
	dbName string
	dbURL  string
	nats   *natstest.Server
	admin  *pgxpool.Pool
	pools  verify.Pools
	slots  []*slot
	client *http.Client

	chaosOn atomic.Bool
	killed  atomic.Int64
	crashes atomic.Int64
	termd   atomic.Int64

	mu    sync.Mutex
	fired map[string]int
	dups  map[string]float64 // per process (slot/gen): the last scraped duplicates
	sup   sync.WaitGroup
}

// Run performs a chaos run; it fails t on any violation or unfired
// failpoint and stops every process it started, whatever happens.
func Run(t testing.TB, cfg Config) Result {
	t.Helper()
	start := time.Now()
	cfg.Copies = max(cfg.Copies, 2)
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	h := &harness{t: t, cfg: cfg, fired: map[string]int{}, dups: map[string]float64{},
		client: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}}
	// A hard deadline for everything below.
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Duration+4*time.Minute)
	defer cancel()

	h.build()
	h.database()
	h.nats = natstest.New(t)
	h.migrate(ctx)
	h.fill(ctx)
	h.startAll()
	h.restock(ctx, []string{"CHAOS-A", "CHAOS-B"})
	h.logf("chaos: %d processes up, chaos for %v at %.1f orders/s", len(h.slots), cfg.Duration, cfg.Rate)

	scrapeCtx, stopScrape := context.WithCancel(ctx)
	scraped := make(chan struct{})
	go func() { defer close(scraped); h.scrapeLoop(scrapeCtx) }()

	h.chaosOn.Store(true)
	for _, s := range h.slots {
		s.arm() // the first failpoint of each queue
	}
	chaosCtx, stopChaos := context.WithTimeout(ctx, cfg.Duration)
	defer stopChaos()
	var wg sync.WaitGroup
	d := &driver{h: h, deadline: time.Now().Add(cfg.Duration + 45*time.Second)}
	wg.Go(func() { d.start(chaosCtx, ctx) })
	var outage time.Duration
	wg.Go(func() { outage = h.chaosLoop(chaosCtx) })
	<-chaosCtx.Done()
	h.chaosOn.Store(false)
	h.logf("chaos: chaos over, waiting for the driver")
	wg.Wait()

	// Stop the chaos: every process is restarted without failpoints.
	h.scrapeAll()
	h.restartClean()
	h.logf("chaos: restarted cleanly; waiting for every saga to end")
	unended := h.waitEnded(ctx, 90*time.Second)
	h.scrapeAll()
	stopScrape()
	<-scraped

	report, err := verify.Wait(ctx, h.pools, app.OutboxRetention, 60*time.Second)
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	res := Result{
		Orders: d.created(), Scenarios: d.results(ctx), Killed: h.killed.Load(), Crashes: h.crashes.Load(),
		Terminated: h.termd.Load(), NATSOutage: outage, Report: report, Violations: report.Violations(),
		Unended: unended, EventsPublished: h.published(ctx),
	}
	h.mu.Lock()
	res.Fired = maps(h.fired)
	for _, v := range h.dups {
		res.Duplicates += int64(v)
	}
	h.mu.Unlock()
	for _, n := range failpoint.Names() {
		if res.Fired[n] == 0 {
			res.NotFired = append(res.NotFired, n)
		}
	}
	res.Elapsed = time.Since(start)
	h.table(res)
	if !report.OK() {
		var b strings.Builder
		report.Write(&b)
		t.Errorf("invariants violated:\n%s", b.String())
	}
	if len(res.NotFired) > 0 {
		t.Errorf("failpoints that never fired: %v", res.NotFired)
	}
	if unended > 0 {
		t.Errorf("%d orders' sagas had not ended after the bounded wait", unended)
	}
	return res
}

func maps(m map[string]int) map[string]int {
	out := make(map[string]int, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func (h *harness) logf(format string, args ...any) {
	fmt.Fprintf(h.cfg.Out, format+"\n", args...)
}

// build compiles cmd/shop once.
func (h *harness) build() {
	dir := h.t.TempDir()
	h.bin = filepath.Join(dir, "shop")
	h.logDir = filepath.Join(dir, "logs")
	if err := os.MkdirAll(h.logDir, 0o755); err != nil {
		h.t.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-o", h.bin, "github.com/shop-ref/shop/cmd/shop")
	if out, err := cmd.CombinedOutput(); err != nil {
		h.t.Fatalf("go build: %v\n%s", err, out)
	}
}

// database creates a throwaway database, dropped at the end.
func (h *harness) database() {
	db := pgtest.NewDatabase(h.t, "shop_chaos_")
	h.dbName, h.dbURL = db.Name, db.URL
}

// withAppName sets application_name in a database URL, so that one
// service's backends can be told apart in pg_stat_activity.
func withAppName(dbURL, name string) string {
	sep := "?"
	if strings.Contains(dbURL, "?") {
		sep = "&"
	}
	return dbURL + sep + "application_name=" + name
}

func (h *harness) migrate(ctx context.Context) {
	cmd := exec.CommandContext(ctx, h.bin, "migrate")
	cmd.Env = h.baseEnv(withAppName(h.dbURL, "chaos-migrate"))
	if out, err := cmd.CombinedOutput(); err != nil {
		h.t.Fatalf("shop migrate: %v\n%s", err, out)
	}
	admin, err := database.NewPool(ctx, withAppName(h.dbURL, "chaos-harness"), "public", 4)
	if err != nil {
		h.t.Fatal(err)
	}
	h.admin = admin
	h.t.Cleanup(admin.Close)
	pools := map[string]*pgxpool.Pool{}
	for _, name := range app.Names {
		p, err := database.NewPool(ctx, withAppName(h.dbURL, "chaos-verify"), migrations.Schemas[name], 2)
		if err != nil {
			h.t.Fatal(err)
		}
		h.t.Cleanup(p.Close)
		pools[name] = p
	}
	h.pools = verify.Pools{Order: pools["order"], Inventory: pools["inventory"], Payment: pools["payment"], Fulfillment: pools["fulfillment"]}
}

// fill puts old published events in fulfillment's outbox (one aggregate of
// its own, gap-free) for retention to delete in more than one batch.
func (h *harness) fill(ctx context.Context) {
	s := pgx.Identifier{migrations.Schemas["fulfillment"]}.Sanitize()
	_, err := h.admin.Exec(ctx, `
		INSERT INTO `+s+`.outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
		                          schema_version, subject, payload, occurred_at, published_at)
		SELECT gen_random_uuid(), 'chaos', 'retention-filler', g, 'ChaosRetentionFiller', 1,
		       'fulfillment.chaos.filler', '{}', now() - interval '100 hours' + g * interval '1 ms',
		       now() - interval '100 hours' + g * interval '1 ms'
		FROM generate_series(1, $1::int) g`, fillerEvents)
	if err == nil {
		_, err = h.admin.Exec(ctx, `INSERT INTO `+s+`.outbox_sequences VALUES ('chaos', 'retention-filler', $1)`, fillerEvents)
	}
	if err != nil {
		h.t.Fatalf("retention filler: %v", err)
	}
}

func freeAddr(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func (h *harness) baseEnv(dbURL string) []string {
	env := []string{
		"DATABASE_URL=" + dbURL,
		"NATS_URL=" + h.nats.URL(),
		"PAYMENT_TIMEOUT=" + paymentTimeout.String(),
		"PAYMENT_WEBHOOK_SECRET=" + webhookSecret,
		"PAYMENT_FAKE_PROVIDER=true", // the driver pays through /simulate
		"OPERATOR_TOKEN=" + operatorToken,
		"FULFILLMENT_DELAY=300ms",
		"DASHBOARD_ADDR=127.0.0.1:0",
	}
	for _, k := range []string{"PATH", "HOME", "TMPDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	return env
}

// startAll starts every copy with its failpoint queue and waits until all
// are ready.
func (h *harness) startAll() {
	bySvc := map[string][]*slot{}
	for _, svc := range app.Names {
		for i := 1; i <= h.cfg.Copies; i++ {
			s := &slot{h: h, name: fmt.Sprintf("%s-%d", svc, i), service: svc, addr: freeAddr(h.t)}
			h.slots = append(h.slots, s)
			bySvc[svc] = append(bySvc[svc], s)
		}
	}
	next := map[string]int{}
	for _, name := range failpoint.Names() {
		p, ok := plan[name]
		if !ok {
			p.service, p.count = "order", 1
		}
		job := fpJob{name, fmt.Sprintf("%s=crash@%d", name, p.count)}
		if name == failpoint.OutboxRetentionMidBatch {
			for _, s := range bySvc[p.service] {
				s.queue = append([]fpJob{job}, s.queue...) // first: it needs a minute
			}
			continue
		}
		s := bySvc[p.service][next[p.service]%len(bySvc[p.service])]
		next[p.service]++
		s.queue = append(s.queue, job)
	}
	// Clean first, so that the shop is ready (and the SKUs known) before
	// anything crashes: the queues are armed when chaos starts.
	h.t.Cleanup(h.stopAll)
	for _, s := range h.slots {
		h.sup.Add(1)
		go s.supervise()
	}
	if err := h.waitReady(); err != nil {
		h.t.Fatalf("%v; log in %s", err, h.logDir)
	}
}

// waitReady waits, for a minute at most, until every process answers
// /readyz.
func (h *harness) waitReady() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, s := range h.slots {
		if err := httpx.WaitReady(ctx, h.client, "http://"+s.addr); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// start starts the slot's process; s.mu is held.
func (s *slot) startLocked(job fpJob) error {
	s.gen++
	f, err := os.Create(filepath.Join(s.h.logDir, fmt.Sprintf("%s-%03d.log", s.name, s.gen)))
	if err != nil {
		return err
	}
	cmd := exec.Command(s.h.bin, s.service)
	cmd.Env = append(s.h.baseEnv(withAppName(s.h.dbURL, "shop-"+s.name)),
		strings.ToUpper(s.service)+"_ADDR="+s.addr,
		failpoint.EnvVar+"="+job.spec)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); f.Close(); close(exited) }()
	s.cmd, s.spec, s.exited, s.running = cmd, job, exited, true
	return nil
}

// supervise keeps the slot's process running until stop.
func (s *slot) supervise() {
	defer s.h.sup.Done()
	for {
		s.mu.Lock()
		if s.stop {
			s.mu.Unlock()
			return
		}
		var job fpJob
		if len(s.queue) > 0 && s.h.chaosOn.Load() {
			job = s.queue[0]
		}
		if err := s.startLocked(job); err != nil {
			s.mu.Unlock()
			s.h.t.Errorf("start %s: %v", s.name, err)
			return
		}
		exited, cmd, gen := s.exited, s.cmd, s.gen
		s.mu.Unlock()

		armTimeout := 40 * time.Second
		if job.name == failpoint.OutboxRetentionMidBatch {
			armTimeout = RetentionWait + 30*time.Second
		}
		timer := time.NewTimer(armTimeout)
		watch := time.NewTicker(200 * time.Millisecond)
	wait:
		for {
			select {
			case <-exited:
				break wait
			case <-watch.C:
				// Chaos is over while a failpoint is armed: restart clean.
				if job.spec != "" && !s.h.chaosOn.Load() {
					_ = cmd.Process.Kill()
				}
			case <-timer.C:
				if job.spec != "" { // it did not fire in time: try again later
					_ = cmd.Process.Kill()
				}
			}
		}
		timer.Stop()
		watch.Stop()
		name := firedIn(filepath.Join(s.h.logDir, fmt.Sprintf("%s-%03d.log", s.name, gen)))
		s.mu.Lock()
		s.running = false
		if name != "" {
			s.h.crashes.Add(1)
			s.h.mu.Lock()
			s.h.fired[name]++
			s.h.mu.Unlock()
			s.queue = slices.DeleteFunc(s.queue, func(j fpJob) bool { return j.name == name })
			// The failpoint has fired somewhere: no other copy needs it.
			for _, o := range s.h.slots {
				if o != s {
					o.dropJob(name)
				}
			}
		} else if job.spec != "" && len(s.queue) > 1 && s.queue[0] == job {
			s.queue = append(s.queue[1:], job) // rotate: try the next one first
		}
		stop := s.stop
		s.mu.Unlock()
		if stop {
			return
		}
		time.Sleep(time.Duration(500+mrand.IntN(1000)) * time.Millisecond)
	}
}

func (s *slot) dropJob(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.spec.name == name {
		return // running with it: leave the process alone
	}
	s.queue = slices.DeleteFunc(s.queue, func(j fpJob) bool { return j.name == name })
}

func firedIn(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if m := firedLine.FindStringSubmatch(sc.Text()); m != nil {
			return m[1]
		}
	}
	return ""
}

// arm SIGKILLs a process started clean that has failpoints queued: the
// supervisor restarts it with the first one armed.
func (s *slot) arm() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running && s.spec.spec == "" && len(s.queue) > 0 && !s.stop {
		_ = s.cmd.Process.Kill()
	}
}

// kill SIGKILLs the slot's process when it runs without a failpoint.
func (s *slot) kill() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running || s.spec.spec != "" || s.stop {
		return false
	}
	return s.cmd.Process.Signal(syscall.SIGKILL) == nil
}

// terminate stops the running process (SIGTERM, then SIGKILL after 15s).
func (s *slot) terminate() {
	s.mu.Lock()
	cmd, exited, running := s.cmd, s.exited, s.running
	s.mu.Unlock()
	if !running {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(15 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
	}
}

// restartClean stops every process; the supervisors start them again
// without failpoints, and this waits until they are ready.
func (h *harness) restartClean() {
	var wg sync.WaitGroup
	for _, s := range h.slots {
		s.mu.Lock()
		s.queue = nil
		s.mu.Unlock()
		wg.Go(s.terminate)
	}
	wg.Wait()
	time.Sleep(2 * time.Second) // the supervisors restart them
	if err := h.waitReady(); err != nil {
		h.t.Errorf("after the clean restart: %v; log in %s", err, h.logDir)
	}
}

// stopAll stops every process the harness started, by PID.
func (h *harness) stopAll() {
	for _, s := range h.slots {
		s.mu.Lock()
		s.stop = true
		s.mu.Unlock()
	}
	var wg sync.WaitGroup
	for _, s := range h.slots {
		wg.Go(s.terminate)
	}
	wg.Wait()
	h.sup.Wait()
}

// ---- chaos ----

// chaosLoop kills random processes until ctx ends; a third of the way in it
// stops NATS for a few seconds, and two thirds in it terminates the
// inventory service's database backends.
func (h *harness) chaosLoop(ctx context.Context) time.Duration {
	start := time.Now()
	natsAt, pgAt := h.cfg.Duration/3, 2*h.cfg.Duration/3
	var outage time.Duration
	natsDone, pgDone := false, false
	for {
		select {
		case <-ctx.Done():
			return outage
		case <-time.After(time.Duration(2500+mrand.IntN(3000)) * time.Millisecond):
		}
		el := time.Since(start)
		switch {
		case !natsDone && el >= natsAt:
			natsDone = true
			d := 4 * time.Second
			h.logf("chaos: NATS down for %v", d)
			h.nats.Stop()
			time.Sleep(d)
			h.nats.Start()
			outage = d
		case !pgDone && el >= pgAt:
			pgDone = true
			h.terminateBackends("inventory")
		default:
			s := h.slots[mrand.IntN(len(h.slots))]
			if s.kill() {
				h.killed.Add(1)
			}
		}
	}
}

// terminateBackends ends every Postgres backend of one service's copies.
func (h *harness) terminateBackends(service string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int64
	err := h.admin.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = $1 AND application_name LIKE $2`, h.dbName, "shop-"+service+"-%").Scan(&n)
	if err != nil {
		h.t.Errorf("terminate %s backends: %v", service, err)
		return
	}
	h.termd.Add(n)
	h.logf("chaos: terminated %d Postgres backends of %s", n, service)
}

// ---- numbers ----

func (h *harness) scrapeLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		h.scrapeAll()
	}
}

// scrapeAll reads shop_consumer_duplicates_total of each live process and
// keeps the last value per process: a process killed between two scrapes
// loses what it absorbed since the last one (an undercount).
func (h *harness) scrapeAll() {
	for _, s := range h.slots {
		s.mu.Lock()
		key, running := fmt.Sprintf("%s/%d", s.name, s.gen), s.running
		s.mu.Unlock()
		if !running {
			continue
		}
		res, err := h.client.Get("http://" + s.addr + "/metrics")
		if err != nil {
			continue
		}
		var sum float64
		sc := bufio.NewScanner(res.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if !strings.HasPrefix(line, "shop_consumer_duplicates_total") {
				continue
			}
			if i := strings.LastIndexByte(line, ' '); i > 0 {
				v, _ := strconv.ParseFloat(line[i+1:], 64)
				sum += v
			}
		}
		res.Body.Close()
		h.mu.Lock()
		h.dups[key] = max(h.dups[key], sum)
		h.mu.Unlock()
	}
}

// published counts the published events of the run (the retention filler
// is older than the retention and not counted).
func (h *harness) published(ctx context.Context) int64 {
	var total int64
	for _, name := range app.Names {
		var n int64
		s := pgx.Identifier{migrations.Schemas[name]}.Sanitize()
		if err := h.admin.QueryRow(ctx, `SELECT count(*) FROM `+s+`.outbox
			WHERE published_at IS NOT NULL AND event_type <> 'ChaosRetentionFiller'`).Scan(&n); err != nil {
			h.t.Errorf("count published events: %v", err)
		}
		total += n
	}
	return total
}

// waitEnded waits until every order is COMPLETED, CLOSED or REJECTED and
// returns how many are not.
func (h *harness) waitEnded(ctx context.Context, timeout time.Duration) int {
	deadline := time.Now().Add(timeout)
	for {
		var n int
		err := h.admin.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{migrations.Schemas["order"]}.Sanitize()+
			`.orders WHERE status NOT IN ('COMPLETED', 'CLOSED', 'REJECTED')`).Scan(&n)
		if err == nil && n == 0 {
			return 0
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return n
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func (h *harness) table(r Result) {
	w := tabwriter.NewWriter(h.cfg.Out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "scenario\torders\tevents published\tduplicates absorbed\tprocesses killed\tfailpoints fired\tviolations\tfinal status\t")
	for _, s := range r.Scenarios {
		fmt.Fprintf(w, "%s\t%d\t-\t-\t-\t-\t-\t%s\t\n", s.Name, s.Orders, statusList(s.Final))
	}
	fmt.Fprintf(w, "all (%v of chaos)\t%d\t%d\t%d\t%d\t%d/%d\t%d\t%d unended\t\n", h.cfg.Duration,
		r.Orders, r.EventsPublished, r.Duplicates, r.Killed, len(failpoint.Names())-len(r.NotFired), len(failpoint.Names()), r.Violations, r.Unended)
	w.Flush()
	fmt.Fprintf(h.cfg.Out, "SIGKILLs %d, failpoint crashes %d, NATS outage %v, Postgres backends terminated %d, wall time %v\n",
		r.Killed, r.Crashes, r.NATSOutage, r.Terminated, r.Elapsed.Round(time.Second))
	names := failpoint.Names()
	parts := make([]string, 0, len(names))
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s×%d", n, r.Fired[n]))
	}
	fmt.Fprintf(h.cfg.Out, "failpoints: %s\n", strings.Join(parts, ", "))
	r.Report.Write(h.cfg.Out)
}

func statusList(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

// ---- HTTP ----

func (h *harness) urls(service string) []string {
	var out []string
	for _, s := range h.slots {
		if s.service == service {
			out = append(out, "http://"+s.addr)
		}
	}
	return out
}

// do sends one request and reads the answer.
func (h *harness) do(ctx context.Context, method, url, key string, header map[string]string, body []byte) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := h.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	return res.StatusCode, b, err
}

// restock stocks the SKUs plentifully and waits until the order service
// knows them (a probe order gets through; it is cancelled).
func (h *harness) restock(ctx context.Context, skus []string) {
	inv := h.urls("inventory")[0]
	for _, sku := range skus {
		st, b, err := h.do(ctx, http.MethodPut, inv+"/stock/"+sku, "", map[string]string{"Authorization": "Bearer " + operatorToken},
			[]byte(`{"on_hand":1000000,"price":250}`))
		if err != nil || st != http.StatusOK {
			h.t.Fatalf("restock %s: %d %s %v", sku, st, b, err)
		}
		for _, ou := range h.urls("order") {
			deadline := time.Now().Add(30 * time.Second)
			for {
				body := fmt.Sprintf(`{"customer_id":"probe","items":[{"sku":%q,"quantity":1}]}`, sku)
				st, b, err := h.do(ctx, http.MethodPost, ou+"/orders", "probe-"+sku+"-"+randHex(), nil, []byte(body))
				if err == nil && st == http.StatusCreated {
					var o struct {
						OrderID string `json:"order_id"`
					}
					_ = json.Unmarshal(b, &o)
					for range 100 {
						st, _, err := h.do(ctx, http.MethodPost, ou+"/orders/"+o.OrderID+"/cancel", "", nil, nil)
						if err == nil && (st == http.StatusAccepted || st == http.StatusConflict) {
							break
						}
						time.Sleep(100 * time.Millisecond)
					}
					break
				}
				if time.Now().After(deadline) {
					h.t.Fatalf("the order service never learned %s: %d %s %v", sku, st, b, err)
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
}

// webhook sends a provider callback signed as the contract says.
func (h *harness) webhook(ctx context.Context, base, orderID, providerID string, amount int64) (int, error) {
	body, _ := json.Marshal(map[string]any{"order_id": orderID, "provider_payment_id": providerID, "status": "succeeded", "amount": amount})
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	mac := hmac.New(sha256.New, []byte(webhookSecret))
	mac.Write([]byte(ts + "." + string(body)))
	st, _, err := h.do(ctx, http.MethodPost, base+"/webhooks/payment", "",
		map[string]string{"Payment-Signature": "t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))}, body)
	return st, err
}

func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
