// Package chaos is the chaos run of the shop (`make chaos`): it builds the
// real `shop` binary and nats-server, starts a three-node NATS cluster (or
// one node) and two copies of every service as separate processes against
// a throwaway Postgres database, each process reaching each node through a
// fault proxy of the harness's own, drives orders through the public HTTP
// API, and meanwhile SIGKILLs processes, fires every failpoint, cuts one
// service's database connections and injects broker faults: a stream
// leader killed, quorum lost, a shop process silently partitioned,
// JetStream disabled on a node, a durable consumer deleted, the whole
// cluster restarted. Then it restarts everything cleanly, waits until every
// saga has ended, checks the contract's invariants with the code of `shop
// verify` and reports what the faults cost (see Result).
package chaos

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/pgtest"
	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/migrations"
)

// Config sizes a run.
type Config struct {
	Duration time.Duration // how long the chaos lasts (at least RetentionWait)
	Rate     float64       // orders started per second while it lasts
	Copies   int           // processes per service (at least 2)
	Nodes    int           // NATS nodes: 3 (a cluster, streams R3; the default) or 1
	Out      io.Writer     // the table and progress lines
	LogDir   string        // where the processes' logs go; empty: the test's temporary directory
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

// Result is what a run saw.
type Result struct {
	Orders          int
	Scenarios       []ScenarioResult
	EventsPublished int64
	Duplicates      int64
	Killed          int64 // SIGKILLs of shop processes by the chaos
	Crashes         int64 // exits by a failpoint
	Fired           map[string]int
	NotFired        []string
	Terminated      int64 // database backends terminated
	Nodes           int   // NATS nodes
	Faults          []Fault
	FaultCounts     map[string]int // faults injected, by kind
	Stalls          []Stall        // the longest saga stall after each of Faults
	Redelivery      []Redelivery   // per SIGKILL with events in flight
	SelfExits       []Exit         // shop processes that exited on their own
	NodeExits       []Exit         // NATS nodes that did
	DeadEvents      int            // outbox rows with dead_at set, in every schema
	StreamLoss      StreamLoss     // acked events missing from their streams, before and after the repair
	Hostile         Hostile        // what the hostile lane sent, and what it left to discard
	// PermissionViolations counts the shop processes' logged NATS
	// permissions violations: something a service needed that its user may
	// not do.
	PermissionViolations int
	DeadNotes            []string
	PeakConns            int // most Postgres client connections to the run's database at once (sampled each second)
	PeakServerConns      int // and to the whole server, which other tests share
	Violations           int
	Report               verify.Report
	Unended              int // orders whose saga had not ended by the deadline
	Elapsed              time.Duration
}

// ScenarioResult counts one kind of order by final status.
type ScenarioResult struct {
	Name   string
	Orders int
	Final  map[string]int
}

type harness struct {
	t       testing.TB
	cfg     Config
	bin     string
	natsBin string
	logDir  string
	dbName  string
	dbURL   string
	nats    *cluster
	admin   *pgxpool.Pool
	hostile *hostile // the hostile lane's peer
	pools   verify.Pools
	slots   []*slot
	client  *http.Client

	chaosStart   time.Time // offsets in the report count from here (until the chaos: from the start of Run)
	cleanRestart time.Time // the end of every stall window

	chaosOn atomic.Bool
	crashes atomic.Int64
	termd   atomic.Int64

	mu              sync.Mutex
	fired           map[string]int
	dups            map[string]float64 // per process (slot/gen): the last scraped duplicates
	kills           []kill
	faults          []*Fault
	exits           []Exit
	peakConns       int
	peakServerConns int
	sup             sync.WaitGroup
}

// Run performs a chaos run; it fails t when a target of the report is
// missed and stops every process it started, whatever happens.
func Run(t testing.TB, cfg Config) Result {
	t.Helper()
	start := time.Now()
	cfg.Copies = max(cfg.Copies, 2)
	if cfg.Nodes != 1 {
		cfg.Nodes = 3
	}
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	h := &harness{t: t, cfg: cfg, fired: map[string]int{}, dups: map[string]float64{}, chaosStart: start,
		client: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}}
	// A hard deadline for everything below.
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Duration+8*time.Minute)
	defer cancel()

	h.build()
	h.database()
	h.nats = newCluster(ctx, t, h.natsBin, filepath.Join(h.logDir, "nats"), cfg.Nodes)
	h.migrate(ctx)
	h.fill(ctx)
	h.startAll()
	h.restock(ctx, []string{"CHAOS-A", "CHAOS-B"})
	h.logf("chaos: %d processes up on %d NATS node(s), chaos for %v at %.1f orders/s", len(h.slots), cfg.Nodes, cfg.Duration, cfg.Rate)

	scrapeCtx, stopScrape := context.WithCancel(ctx)
	scraped := make(chan struct{})
	go func() { defer close(scraped); h.scrapeLoop(scrapeCtx) }()

	var err error
	// The hostile peer has the order service's NATS rights: it may publish
	// only where a buggy order service could write (orders.>).
	orderNC, err := h.nats.connect("order")
	if err != nil {
		t.Fatalf("hostile peer: %v", err)
	}
	if h.hostile, err = newHostile(h, orderNC); err != nil {
		t.Fatal(err)
	}
	h.chaosOn.Store(true)
	for _, s := range h.slots {
		s.arm() // the first failpoint of each queue
	}
	h.chaosStart = time.Now()
	chaosCtx, stopChaos := context.WithTimeout(ctx, cfg.Duration)
	defer stopChaos()
	var wg sync.WaitGroup
	d := &driver{h: h, deadline: time.Now().Add(cfg.Duration + 45*time.Second)}
	wg.Go(func() { d.start(chaosCtx, ctx) })
	wg.Go(func() { h.chaos(chaosCtx) })
	<-chaosCtx.Done()
	h.chaosOn.Store(false)
	h.logf("chaos: chaos over, waiting for the driver and for every fault to heal")
	wg.Wait()
	if err := h.nats.waitHealthy(ctx, healthyIn); err != nil {
		t.Errorf("after the chaos: %v", err)
	}

	// Stop the chaos: every process is restarted without failpoints.
	h.scrapeAll()
	h.cleanRestart = time.Now()
	h.restartClean()
	h.logf("chaos: restarted cleanly; waiting for every saga to end")
	unended := h.waitEnded(ctx, 90*time.Second)
	h.scrapeAll()
	stopScrape()
	<-scraped

	hostileRes, err := h.hostile.cleanUp(ctx)
	if err != nil {
		t.Errorf("hostile lane: %v", err)
	}
	loss, err := h.auditStreams(ctx)
	if err != nil {
		t.Errorf("stream audit: %v", err)
	}
	report, err := h.verify(ctx)
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	res := h.result(ctx, d, report, unended)
	res.StreamLoss = loss
	res.Hostile = hostileRes
	res.Elapsed = time.Since(start)
	h.table(res)
	h.judge(res)
	return res
}

// verify runs the checks of `shop verify` until they pass, for a minute at
// most, also while the database refuses connections (a shared server that
// is full).
func (h *harness) verify(ctx context.Context) (verify.Report, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		report, err := verify.Wait(ctx, h.pools, app.OutboxRetention, time.Until(deadline))
		if err == nil || time.Now().After(deadline) || !sleepCtx(ctx, time.Second) {
			return report, err
		}
		h.logf("chaos: verify: %v; trying again", err)
	}
}

// result gathers the figures of the report.
func (h *harness) result(ctx context.Context, d *driver, report verify.Report, unended int) Result {
	res := Result{
		Orders: d.created(), Scenarios: d.results(ctx), Crashes: h.crashes.Load(), Nodes: len(h.nats.nodes),
		Terminated: h.termd.Load(), Report: report, Violations: report.Violations(),
		Unended: unended, EventsPublished: h.published(ctx), NodeExits: h.nats.exits(),
		FaultCounts: map[string]int{},
	}
	h.mu.Lock()
	res.Fired = maps.Clone(h.fired)
	for _, v := range h.dups {
		res.Duplicates += int64(v)
	}
	res.Killed = int64(len(h.kills))
	res.Faults = h.faultsCopy()
	res.SelfExits = append([]Exit(nil), h.exits...)
	res.PeakConns, res.PeakServerConns = h.peakConns, h.peakServerConns
	h.mu.Unlock()
	for _, n := range failpoint.Names() {
		if res.Fired[n] == 0 {
			res.NotFired = append(res.NotFired, n)
		}
	}
	sp, err := h.history(ctx)
	if err != nil {
		h.t.Errorf("%v", err)
	}
	for _, f := range res.Faults {
		res.FaultCounts[f.Kind]++
	}
	res.Stalls = sp.stalls(res.Faults, h.cleanRestart)
	if res.Redelivery, err = h.redelivery(ctx); err != nil {
		h.t.Errorf("%v", err)
	}
	if res.DeadEvents, res.DeadNotes, err = h.deadEvents(ctx); err != nil {
		h.t.Errorf("%v", err)
	}
	for _, s := range h.slots {
		res.PermissionViolations += s.permissionViolations()
	}
	return res
}

// judge fails the test on every target the run missed.
func (h *harness) judge(r Result) {
	t := h.t
	if !r.Report.OK() {
		var b strings.Builder
		r.Report.Write(&b)
		t.Errorf("invariants violated:\n%s", b.String())
	}
	if len(r.NotFired) > 0 {
		t.Errorf("failpoints that never fired: %v", r.NotFired)
	}
	if r.Unended > 0 {
		t.Errorf("%d orders' sagas had not ended after the bounded wait", r.Unended)
	}
	if n := len(r.SelfExits); n > 0 {
		t.Errorf("%d shop processes exited on their own (by cause above; %s)", n, r.SelfExits[0].Cause())
	}
	if n := len(r.NodeExits); n > 0 {
		t.Errorf("%d NATS nodes exited on their own (above; %s)", n, r.NodeExits[0].Cause())
	}
	if r.DeadEvents > 0 {
		t.Errorf("%d dead events: nothing in the run is poison, so an outage burnt their attempts: %v", r.DeadEvents, r.DeadNotes)
	}
	if r.Hostile.Early == 0 || r.Hostile.Garbage == 0 {
		t.Errorf("the hostile lane sent %+v: no early events or no garbage (chaos too short?)", r.Hostile)
	}
	if r.PermissionViolations > 0 {
		t.Errorf("the shop processes logged %d NATS permissions violations: a service needs what its user may not do (broker.Permissions)", r.PermissionViolations)
	}
	if r.StreamLoss.After > 0 {
		t.Errorf("%d acked events still missing from their streams after the repair: %v", r.StreamLoss.After, r.StreamLoss.Notes)
	}
	if r.Nodes > 1 {
		for _, k := range []string{KindLeaderKill, KindQuorumLoss} {
			if r.FaultCounts[k] == 0 {
				t.Errorf("the run injected no %s (chaos too short?)", k)
			}
		}
	}
}

func (h *harness) logf(format string, args ...any) {
	fmt.Fprintf(h.cfg.Out, format+"\n", args...)
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
	cmd.Env = h.env(withAppName(h.dbURL, "chaos-migrate"), "")
	if out, err := cmd.CombinedOutput(); err != nil {
		h.t.Fatalf("shop migrate: %v\n%s", err, out)
	}
	admin, err := database.NewPool(ctx, withAppName(h.dbURL, "chaos-harness"), "public", 3)
	if err != nil {
		h.t.Fatal(err)
	}
	h.admin = admin
	if err := admin.Ping(ctx); err != nil { // one connection held from now on (see below)
		h.t.Fatal(err)
	}
	h.t.Cleanup(admin.Close)
	pools := map[string]*pgxpool.Pool{}
	for _, name := range app.Names {
		// One connection each: verify's queries run one at a time, and
		// Postgres's 100 connections are shared with the eight processes.
		p, err := database.NewPool(ctx, withAppName(h.dbURL, "chaos-verify"), migrations.Schemas[name], 1)
		if err != nil {
			h.t.Fatal(err)
		}
		h.t.Cleanup(p.Close)
		// Connected now and kept: a Postgres server that other tests fill
		// up later must not leave the final checks without a connection.
		if err := p.Ping(ctx); err != nil {
			h.t.Fatal(err)
		}
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

// fatalf ends a run that cannot go on, after printing the exits so far:
// a start-up that fails is most often a process that gave up.
func (h *harness) fatalf(format string, args ...any) {
	h.mu.Lock()
	exits := append([]Exit(nil), h.exits...)
	h.mu.Unlock()
	writeExits(h.cfg.Out, "shop processes", exits, h.offset)
	h.t.Fatalf(format, args...)
}
