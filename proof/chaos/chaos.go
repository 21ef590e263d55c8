package chaos

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/pgcluster"
)

// Config sizes a run.
type Config struct {
	// Services are the shop's services as the binary under test runs them:
	// services.All, which only cmd/shop wires (the test passes it).
	Services registry.Registry
	// BuildTags build cmd/shop with that list of services
	// (services.BuildTags): processes of another build would run another.
	BuildTags string
	Duration  time.Duration // how long the chaos lasts (at least RetentionWait)
	Rate      float64       // orders started per second while it lasts
	Copies    int           // processes per service (at least 2)
	Nodes     int           // NATS nodes: 3 (a cluster, streams R3; the default) or 1
	Out       io.Writer     // the table and progress lines
	LogDir    string        // where the processes' logs go; empty: the test's temporary directory
	// Lanes are the fault lanes that run (Lane*); empty: all of them. One
	// lane alone measures its faults' stalls without another lane's
	// faults overlapping them.
	Lanes []string
}

// The fault lanes (see harness.chaos).
const (
	LaneProcess   = "process"   // SIGKILLs, failpoints, a NATS connection reset, Postgres backends terminated
	LaneBroker    = "broker"    // NATS node and stream faults, one after another
	LanePartition = "partition" // one shop process silently cut off every node
	LaneHostile   = "hostile"   // a peer publishing forged and garbage events
	// LaneCDC runs every relay in ModeCDC (RELAY_MODE=cdc) on a private
	// Postgres cluster of the run's own, and kills streaming relays,
	// drops their slots and restarts that Postgres (see cdcLane).
	LaneCDC = "cdc"
)

// Lanes are every fault lane that runs by default, in the order the
// report names them.
var Lanes = []string{LaneProcess, LaneBroker, LanePartition, LaneHostile}

// OptInLanes run only when named: LaneCDC changes how every relay of the
// run works, and moves its database off the shared server.
var OptInLanes = []string{LaneCDC}

// lane reports whether lane runs.
func (c Config) lane(lane string) bool {
	if len(c.Lanes) == 0 {
		return slices.Contains(Lanes, lane)
	}
	return slices.Contains(c.Lanes, lane)
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
	// RelayKills are the SIGKILLs of the cdc lane: each of the process
	// whose relay streamed its service's slot at that moment.
	RelayKills  int64
	Slots       []outbox.SlotStats // the cdc lane: every service's slot at the end
	Nodes       int                // NATS nodes
	Faults      []Fault
	FaultCounts map[string]int // faults injected, by kind
	Stalls      []Stall        // the longest saga stall after each of Faults
	Redelivery  []Redelivery   // per SIGKILL with events in flight
	SelfExits   []Exit         // shop processes that exited on their own
	NodeExits   []Exit         // NATS nodes that did
	DeadEvents  int            // outbox rows with dead_at set, in every schema
	StreamLoss  StreamLoss     // acked events missing from their streams, before and after the repair
	Hostile     Hostile        // what the hostile lane sent, and what it left to discard
	// PermissionViolations counts the shop processes' logged NATS
	// permissions violations: something a service needed that its user may
	// not do.
	PermissionViolations int
	DeadNotes            []string
	PeakConns            int // most Postgres client connections to the run's database at once (sampled each second)
	PeakServerConns      int // and to the whole server, which other tests share
	Violations           int
	Report               verify.Report
	Unended              int      // orders whose saga had not ended by the deadline
	RefusedPays          []string // payments refused the moment their order said WAIT_PAY
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
	hostile *hostile           // the hostile lane's peer
	pg      *pgcluster.Cluster // the cdc lane's private Postgres; nil: the shared server
	shop    verify.Shop
	slots   []*slot
	client  *http.Client

	chaosStart   time.Time // offsets in the report count from here (until the chaos: from the start of Run)
	cleanRestart time.Time // the end of every stall window

	chaosOn    atomic.Bool
	crashes    atomic.Int64
	termd      atomic.Int64
	relayKills atomic.Int64

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
	if len(cfg.Services) == 0 {
		t.Fatal("chaos: Config.Services is empty: pass the services the shop binary runs (services.All)")
	}
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
	h.nats = newCluster(ctx, t, h.natsBin, filepath.Join(h.logDir, "nats"), cfg.Nodes, cfg.Services)
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
	if cfg.lane(LaneHostile) {
		orderNC, err := h.nats.connect("order")
		if err != nil {
			t.Fatalf("hostile peer: %v", err)
		}
		if h.hostile, err = newHostile(h, orderNC); err != nil {
			t.Fatal(err)
		}
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

	var hostileRes Hostile
	if h.hostile != nil {
		if hostileRes, err = h.hostile.cleanUp(ctx); err != nil {
			t.Errorf("hostile lane: %v", err)
		}
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

func (h *harness) logf(format string, args ...any) {
	fmt.Fprintf(h.cfg.Out, format+"\n", args...)
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
