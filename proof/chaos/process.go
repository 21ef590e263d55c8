package chaos

import (
	"cmp"
	"context"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/httpx"
)

// slot is one service copy: a supervisor restarts its process whenever it
// exits, armed with the next failpoint of its queue while chaos is on. It
// reaches each NATS node through a proxy of its own.
type slot struct {
	h       *harness
	name    string // order-1
	service string
	addr    string
	proxies []*proxy // one per node, in node order

	mu          sync.Mutex
	cmd         *exec.Cmd
	gen         int
	spec        fpJob // armed in the running process
	queue       []fpJob
	stop        bool
	exited      chan struct{}
	running     bool
	signalled   bool // the harness sent the running process a signal
	partitioned bool // cut off NATS by a partition: not SIGKILLed meanwhile
}

// build compiles cmd/shop and nats-server, at the version go.mod requires,
// in one go build (they share its parallelism and cache).
func (h *harness) build() {
	dir := h.t.TempDir()
	h.bin, h.natsBin = filepath.Join(dir, "shop"), filepath.Join(dir, "nats-server")
	h.logDir = cmp.Or(h.cfg.LogDir, filepath.Join(dir, "logs"))
	if err := os.MkdirAll(h.logDir, 0o755); err != nil {
		h.t.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-tags", h.cfg.BuildTags, "-o", dir+string(filepath.Separator),
		"github.com/shop-ref/shop/cmd/shop", "github.com/nats-io/nats-server/v2")
	if out, err := cmd.CombinedOutput(); err != nil {
		h.t.Fatalf("go build: %v\n%s", err, out)
	}
}

func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// env is a shop process's environment; natsURL is its list of servers.
func (h *harness) env(dbURL, natsURL string) []string {
	env := []string{
		"DATABASE_URL=" + dbURL,
		"NATS_URL=" + natsURL,
		fmt.Sprintf("NATS_REPLICAS=%d", len(h.nats.nodes)),
		"PAYMENT_TIMEOUT=" + paymentTimeout.String(),
		// Unpaid orders close 10s after pay_by (payment's grace for payments
		// on their way), and the order's safety net asks payment a second
		// after pay_by, so the saga's timeout scanner fires (and its
		// failpoint, saga.after_claim_timeout) within a short run.
		"PAYMENT_CAPTURE_GRACE=10s",
		"ORDER_PAYMENT_OVERDUE=1s",
		"PAYMENT_WEBHOOK_SECRET=" + webhookSecret,
		"PAYMENT_FAKE_PROVIDER=true", // the driver pays through /simulate
		"OPERATOR_TOKEN=" + operatorToken,
		"FULFILLMENT_DELAY=300ms",
		"DASHBOARD_ADDR=127.0.0.1:0",
		// The order processes' reconciler audits the streams and repairs
		// often, so that what an empty cluster lost is republished within
		// the run, by the shop itself.
		"RECONCILE_INTERVAL=" + reconcileEvery.String(),
		broker.PasswordVar(broker.AuditUser) + "=" + h.nats.passwords[broker.AuditUser],
	}
	// Every process relays one way: the cdc lane's relays stream their
	// outbox from a replication slot, the others poll (the shop's default
	// is cdc; a run without the lane proves the poller).
	env = append(env, "RELAY_MODE="+string(h.cfg.relayMode()))
	for _, k := range []string{"PATH", "HOME", "TMPDIR"} {
		if v, ok := os.LookupEnv(k); ok {
			env = append(env, k+"="+v)
		}
	}
	return env
}

// natsURL lists the slot's proxies, one per node.
func (s *slot) natsURL() string {
	urls := make([]string, len(s.proxies))
	for i, p := range s.proxies {
		urls[i] = p.URL()
	}
	return strings.Join(urls, ",")
}

// startAll starts every copy with its failpoint queue and waits until all
// are ready.
func (h *harness) startAll() {
	bySvc := map[string][]*slot{}
	// Each copy's HTTP port stays held until every proxy listens: a port
	// taken by freePort and closed at once could be handed to a proxy
	// created next, and the copy then never binds its address.
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	for _, svc := range h.cfg.Services.Names() {
		for i := 1; i <= h.cfg.Copies; i++ {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				h.t.Fatal(err)
			}
			held = append(held, l)
			s := &slot{h: h, name: fmt.Sprintf("%s-%d", svc, i), service: svc, addr: l.Addr().String()}
			for _, nd := range h.nats.nodes {
				p, err := newProxy(nd.addr())
				if err != nil {
					h.t.Fatalf("proxy for %s to %s: %v", s.name, nd.name, err)
				}
				h.t.Cleanup(p.Close)
				s.proxies = append(s.proxies, p)
			}
			h.slots = append(h.slots, s)
			bySvc[svc] = append(bySvc[svc], s)
		}
	}
	for _, l := range held {
		l.Close()
	}
	held = nil
	next := map[string]int{}
	for _, name := range h.cfg.failpoints() {
		if !h.cfg.lane(LaneProcess) {
			break // failpoints are the process lane's
		}
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
	if err := h.waitReady(context.Background(), time.Minute); err != nil {
		h.fatalf("%v; log in %s", err, h.logDir)
	}
}

// waitReady waits, for timeout at most, until every process answers
// /readyz.
func (h *harness) waitReady(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, s := range h.slots {
		if err := httpx.WaitReady(ctx, h.client, "http://"+s.addr); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

func (s *slot) logPath(gen int) string {
	return filepath.Join(s.h.logDir, fmt.Sprintf("%s-%03d.log", s.name, gen))
}

// startLocked starts the slot's process; s.mu is held. The returned
// channel yields what Wait reported, once the process has exited.
func (s *slot) startLocked(job fpJob) (<-chan error, error) {
	s.gen++
	f, err := os.Create(s.logPath(s.gen))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(s.h.bin, s.service)
	cmd.SysProcAttr = orphanKill()
	cmd.Env = append(s.h.env(withAppName(s.h.dbURL, "shop-"+s.name), s.natsURL()),
		strings.ToUpper(s.service)+"_ADDR="+s.addr,
		broker.PasswordVar(s.service)+"="+s.h.nats.passwords[s.service], // its own NATS user, no other's
		failpoint.EnvVar+"="+job.spec)
	if s.service == "order" {
		// As docker-compose.yml: the stream keeper runs where the
		// reconciler does, creates the streams (an empty cluster's anew,
		// with the shop's configuration: no service may) and restores what
		// the run does to a stream's configuration.
		cmd.Env = append(cmd.Env, broker.PasswordVar(broker.StreamsUser)+"="+s.h.nats.passwords[broker.StreamsUser])
	}
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, err
	}
	exited, status := make(chan struct{}), make(chan error, 1)
	go func() { status <- cmd.Wait(); f.Close(); close(exited) }()
	s.cmd, s.spec, s.exited, s.running, s.signalled = cmd, job, exited, true, false
	return status, nil
}

// signalLocked sends the running process sig and notes that the harness
// caused its exit; s.mu is held.
func (s *slot) signalLocked(sig syscall.Signal) bool {
	if !s.running {
		return false
	}
	s.signalled = true
	return s.cmd.Process.Signal(sig) == nil
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
		status, err := s.startLocked(job)
		if err != nil {
			s.mu.Unlock()
			s.h.t.Errorf("start %s: %v", s.name, err)
			return
		}
		exited, gen := s.exited, s.gen
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
					s.mu.Lock()
					s.signalLocked(syscall.SIGKILL)
					s.mu.Unlock()
				}
			case <-timer.C:
				if job.spec != "" { // it did not fire in time: try again later
					s.mu.Lock()
					s.signalLocked(syscall.SIGKILL)
					s.mu.Unlock()
				}
			}
		}
		timer.Stop()
		watch.Stop()
		werr := <-status
		name := firedIn(s.logPath(gen))
		s.mu.Lock()
		s.running = false
		switch {
		case name != "":
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
		case !s.signalled:
			// Neither the harness nor a failpoint ended it: the process
			// gave up on its own, which no fault of the run should cause.
			s.h.mu.Lock()
			s.h.exits = append(s.h.exits, Exit{Who: s.name, Gen: gen, At: time.Now(),
				Status: fmt.Sprint(werr), Tail: tail(s.logPath(gen), 15)})
			s.h.mu.Unlock()
			s.h.logf("chaos: %s (start %d) exited on its own: %v", s.name, gen, werr)
		case job.spec != "" && len(s.queue) > 1 && s.queue[0] == job:
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

// permissionViolations counts the NATS permissions violations the slot's
// processes logged, over every start.
func (s *slot) permissionViolations() int {
	s.mu.Lock()
	gens := s.gen
	s.mu.Unlock()
	n := 0
	for gen := 1; gen <= gens; gen++ {
		b, err := os.ReadFile(s.logPath(gen))
		if err == nil {
			n += strings.Count(string(b), `msg="nats permissions violation"`)
		}
	}
	return n
}

// orphanKill makes the kernel SIGKILL a child when the test process dies
// without its cleanups (a -timeout panic, a SIGKILL): t.Cleanup stops the
// children of a run that ends, this the children of one that is killed.
// (Pdeathsig follows the thread that started the child; the Go runtime
// ends threads only for goroutines that locked one, which the harness
// does not.)
func orphanKill() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// kill SIGKILLs the slot's process when it runs without a failpoint and
// is not partitioned (a partition is a fault of its own, measured alone).
func (s *slot) kill() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.spec.spec != "" || s.stop || s.partitioned {
		return false
	}
	return s.signalLocked(syscall.SIGKILL)
}

// pid is the running process's id, or 0.
func (s *slot) pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		return 0
	}
	return s.cmd.Process.Pid
}

// terminate stops the running process (SIGTERM, then SIGKILL after 15s).
func (s *slot) terminate() {
	s.mu.Lock()
	exited := s.exited
	sent := s.signalLocked(syscall.SIGTERM)
	s.mu.Unlock()
	if !sent {
		return
	}
	select {
	case <-exited:
	case <-time.After(15 * time.Second):
		s.mu.Lock()
		s.signalLocked(syscall.SIGKILL)
		s.mu.Unlock()
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
	if err := h.waitReady(context.Background(), time.Minute); err != nil {
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
