package chaos

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/shop-ref/shop/internal/registry"
)

// The broker faults, as the report names them.
const (
	KindLeaderKill     = "stream-leader kill" // SIGKILL of the node leading a stream, restarted after leaderDown
	KindQuorumLoss     = "quorum loss"        // two of three nodes down for quorumDown
	KindPartition      = "silent partition"   // one shop process's proxies paused for partitionFor
	KindJetStreamOff   = "JetStream disabled" // one node's JetStream off (config reload) for jetStreamOff
	KindConsumerDelete = "consumer deleted"   // an operator deletes a durable consumer
	KindClusterRestart = "cluster restart"    // every node stopped for clusterDown (the single node's outage)
	KindEmptyRestart   = "empty cluster"      // every node killed, its store deleted, started again: streams and consumers gone
	KindConnReset      = "connections reset"  // one shop process's connections to NATS reset (RST)
)

// How long each fault lasts; every one is healed when the chaos ends, too.
const (
	// leaderDown is longer than Raft's longest election timeout (9s in
	// nats-server 2.15, raft.go), so that the other two nodes must elect
	// new leaders while the old one is away.
	leaderDown   = 10 * time.Second
	quorumDown   = 20 * time.Second
	partitionFor = 45 * time.Second
	jetStreamOff = 15 * time.Second
	clusterDown  = 4 * time.Second
	faultGap     = 4 * time.Second  // between two faults of the broker lane
	healthyIn    = 60 * time.Second // how long a healed cluster may take to be healthy again
	// reconcileEvery is the shop processes' RECONCILE_INTERVAL in the run.
	reconcileEvery = 5 * time.Second
)

// Fault is one broker fault as it was injected: from Start until Heal (the
// moment the harness undid it: the node restarted, the proxies resumed;
// Start for an instant fault).
type Fault struct {
	Kind, Target string
	Start, Heal  time.Time
	Note         string // what the harness saw while healing
}

// kill is one SIGKILL of a shop process by the chaos.
type kill struct {
	slot, service string
	at            time.Time
}

// streamNames are the shop's streams, in the order the faults pick them.
func (h *harness) streamNames() []string {
	var names []string
	for _, e := range h.cfg.Services {
		names = append(names, e.Stream)
	}
	return names
}

// durables are the shop's durable consumers, in the order the operator
// deletes them.
func (h *harness) durables() []registry.Reader { return h.cfg.Services.Readers() }

// chaos runs the fault lanes until ctx ends and returns once every fault
// they injected has healed: shop processes (SIGKILLs, failpoints, a reset
// of NATS connections, Postgres), broker faults one after another,
// partitions of one shop process, which overlap the broker lane's faults as
// they would in life, with a hostile peer, the hostile lane (hostile.go),
// and with relays in ModeCDC, the cdc lane (cdc.go).
func (h *harness) chaos(ctx context.Context) {
	var wg sync.WaitGroup
	if h.cfg.lane(LaneProcess) {
		wg.Go(func() { h.processLane(ctx) })
	}
	if h.cfg.lane(LaneBroker) {
		wg.Go(func() { h.brokerLane(ctx) })
	}
	if h.cfg.lane(LanePartition) {
		wg.Go(func() { h.partitionLane(ctx) })
	}
	if h.hostile != nil {
		wg.Go(func() { h.hostileLane(ctx, h.hostile) })
	}
	if h.cfg.lane(LaneCDC) {
		wg.Go(func() { h.cdcLane(ctx) })
	}
	wg.Wait()
}

func (h *harness) begin(kind, target string) *Fault {
	f := &Fault{Kind: kind, Target: target, Start: time.Now()}
	h.mu.Lock()
	h.faults = append(h.faults, f)
	h.mu.Unlock()
	h.logf("chaos: +%v %s: %s", h.offset(f.Start), kind, target)
	return f
}

func (h *harness) healed(f *Fault, note string) {
	h.mu.Lock()
	f.Heal, f.Note = time.Now(), note
	h.mu.Unlock()
	h.logf("chaos: +%v %s healed: %s", h.offset(f.Heal), f.Kind, note)
}

func (h *harness) offset(t time.Time) time.Duration {
	return t.Sub(h.chaosStart).Round(100 * time.Millisecond)
}

// processLane SIGKILLs random processes until ctx ends; half way it resets
// one process's NATS connections, two thirds in it terminates the
// inventory service's database backends.
func (h *harness) processLane(ctx context.Context) {
	resetAt, pgAt := h.cfg.Duration/2, 2*h.cfg.Duration/3
	resetDone, pgDone := false, false
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(2500+mrand.IntN(3000)) * time.Millisecond):
		}
		el := time.Since(h.chaosStart)
		switch {
		case !resetDone && el >= resetAt:
			resetDone = true
			s := h.connected()
			if s == nil {
				continue
			}
			f := h.begin(KindConnReset, s.name)
			n := 0
			for _, p := range s.proxies {
				n += p.Reset()
			}
			h.healed(f, fmt.Sprintf("%d sockets reset", n))
		case !pgDone && el >= pgAt:
			pgDone = true
			h.terminateBackends("inventory")
		default:
			s := h.slots[mrand.IntN(len(h.slots))]
			if s.kill() {
				h.mu.Lock()
				h.kills = append(h.kills, kill{slot: s.name, service: s.service, at: time.Now()})
				h.mu.Unlock()
			}
		}
	}
}

// connected picks a running, unpartitioned shop process at random.
func (h *harness) connected() *slot {
	for _, i := range mrand.Perm(len(h.slots)) {
		s := h.slots[i]
		s.mu.Lock()
		ok := s.running && !s.partitioned
		s.mu.Unlock()
		if ok {
			return s
		}
	}
	return nil
}

// brokerLane injects the broker faults one after another, round after
// round, each only when it can end before the chaos does.
func (h *harness) brokerLane(ctx context.Context) {
	type step struct {
		need time.Duration
		run  func(ctx context.Context, round int)
	}
	steps := []step{
		{leaderDown + 5*time.Second, h.leaderKill},
		{clusterDown + 15*time.Second, h.emptyRestart},
		{quorumDown + 5*time.Second, h.quorumLoss},
		{jetStreamOff + 5*time.Second, h.jetStreamOff},
		{2 * time.Second, h.deleteConsumer},
		{clusterDown + 5*time.Second, h.clusterRestart},
	}
	if len(h.nats.nodes) == 1 { // no leader to lose but the one node, no quorum
		steps = []step{steps[5], steps[1], steps[3], steps[4]}
	}
	end, _ := ctx.Deadline()
	// Chaos begins by restarting every process that has a failpoint queued
	// (arm): the first broker fault waits until they are up again, so that
	// its stall is its own and not their start-up's.
	if !sleepCtx(ctx, time.Second) {
		return
	}
	_ = h.waitReady(ctx, 20*time.Second)
	if !sleepCtx(ctx, 2*time.Second) {
		return
	}
	for i, skipped := 0, 0; skipped < len(steps); i++ {
		st := steps[i%len(steps)]
		if time.Until(end) < st.need {
			skipped++
			continue
		}
		skipped = 0
		st.run(ctx, i/len(steps))
		if !sleepCtx(ctx, faultGap) {
			return
		}
	}
}

// healthy waits until the cluster is healthy again and says how long
// that took, for the fault's note.
func (h *harness) healthy(ctx context.Context) string {
	t0 := time.Now()
	if err := h.nats.waitHealthy(ctx, healthyIn); err != nil {
		h.logf("chaos: %v", err)
		return "cluster NOT healthy: " + err.Error()
	}
	return fmt.Sprintf("cluster healthy %.1fs after", time.Since(t0).Seconds())
}

// leaderKill SIGKILLs the node that leads one stream (the JetStream API's
// stream info names it) and restarts it after leaderDown.
func (h *harness) leaderKill(ctx context.Context, round int) {
	streams := h.streamNames()
	stream := streams[round%len(streams)]
	nd, err := h.nats.streamLeader(ctx, stream)
	if err != nil {
		h.logf("chaos: no stream-leader kill: %v", err)
		return
	}
	f := h.begin(KindLeaderKill, fmt.Sprintf("%s (leads %s)", nd.name, stream))
	nd.stop(syscall.SIGKILL)
	sleepCtx(ctx, leaderDown)
	heal := context.WithoutCancel(ctx)
	if err := nd.start(); err != nil {
		h.t.Errorf("restart nats %s: %v", nd.name, err)
	}
	h.healed(f, "restarted; "+h.healthy(heal))
}

// quorumLoss stops two of the three nodes for quorumDown, by SIGKILL in
// even rounds and SIGTERM in odd ones, so that no stream and not the meta
// group has a majority.
func (h *harness) quorumLoss(ctx context.Context, round int) {
	n := len(h.nats.nodes)
	a, b := h.nats.nodes[round%n], h.nats.nodes[(round+1)%n]
	sig, how := syscall.SIGKILL, "SIGKILL"
	if round%2 == 1 {
		sig, how = syscall.SIGTERM, "SIGTERM"
	}
	f := h.begin(KindQuorumLoss, fmt.Sprintf("%s and %s (%s)", a.name, b.name, how))
	var wg sync.WaitGroup
	wg.Go(func() { a.stop(sig) })
	wg.Go(func() { b.stop(sig) })
	wg.Wait()
	sleepCtx(ctx, quorumDown)
	heal := context.WithoutCancel(ctx)
	for _, nd := range []*node{a, b} {
		if err := nd.start(); err != nil {
			h.t.Errorf("restart nats %s: %v", nd.name, err)
		}
	}
	h.healed(f, "restarted; "+h.healthy(heal))
}

// jetStreamOff disables JetStream on the node that leads one stream while
// its core NATS stays up (a configuration reload), and enables it again
// after jetStreamOff.
func (h *harness) jetStreamOff(ctx context.Context, round int) {
	streams := h.streamNames()
	stream := streams[(round+1)%len(streams)]
	nd, err := h.nats.streamLeader(ctx, stream)
	if err != nil {
		h.logf("chaos: JetStream not disabled: %v", err)
		return
	}
	f := h.begin(KindJetStreamOff, fmt.Sprintf("%s (led %s)", nd.name, stream))
	if err := nd.setJetStream(ctx, false); err != nil {
		h.t.Errorf("disable JetStream: %v", err)
	}
	sleepCtx(ctx, jetStreamOff)
	heal := context.WithoutCancel(ctx)
	note := "re-enabled; "
	if err := nd.setJetStream(heal, true); err != nil {
		h.t.Errorf("enable JetStream again: %v", err)
		note = "NOT re-enabled: " + err.Error() + "; "
	}
	h.healed(f, note+h.healthy(heal))
}

// deleteConsumer deletes a durable consumer through the JetStream API, as
// an operator might, and notes when the shop has created it again.
func (h *harness) deleteConsumer(ctx context.Context, round int) {
	all := h.durables()
	d := all[round%len(all)]
	f := h.begin(KindConsumerDelete, d.Name+" on "+d.Stream)
	if err := h.nats.deleteConsumer(ctx, d.Stream, d.Name); err != nil {
		h.healed(f, err.Error())
		return
	}
	h.healed(f, "deleted")
	wait, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		if ok, _ := h.nats.hasConsumer(wait, d.Stream, d.Name); ok {
			h.mu.Lock()
			f.Note = fmt.Sprintf("deleted; the shop created it again %.1fs later", time.Since(f.Start).Seconds())
			h.mu.Unlock()
			return
		}
		if !sleepCtx(wait, 200*time.Millisecond) {
			h.mu.Lock()
			f.Note = fmt.Sprintf("deleted; not created again within %.0fs", time.Since(f.Start).Seconds())
			h.mu.Unlock()
			return
		}
	}
}

// clusterRestart stops every node (SIGTERM) for clusterDown and starts
// them again, their stores as they were.
func (h *harness) clusterRestart(ctx context.Context, _ int) {
	h.restartAll(ctx, h.begin(KindClusterRestart, fmt.Sprintf("all %d nodes (SIGTERM)", len(h.nats.nodes))), syscall.SIGTERM, false)
}

// emptyRestart kills every node, deletes its store and starts it again:
// a cluster that comes back empty, every stream and durable consumer gone
// with every message in them. Nothing may need a person after it: the
// relays wait for their streams (no event dies of "no stream"), the owners
// create the streams again, the consumers their durables, and the
// reconciler (RECONCILE_INTERVAL here, in the order processes, with the
// audit user) republishes what the streams lost.
func (h *harness) emptyRestart(ctx context.Context, _ int) {
	h.restartAll(ctx, h.begin(KindEmptyRestart, fmt.Sprintf("all %d nodes (SIGKILL, stores deleted)", len(h.nats.nodes))), syscall.SIGKILL, true)
}

// restartAll stops every node with sig, deletes its store when empty is
// set, waits clusterDown and starts them again.
func (h *harness) restartAll(ctx context.Context, f *Fault, sig syscall.Signal, empty bool) {
	var wg sync.WaitGroup
	for _, nd := range h.nats.nodes {
		wg.Go(func() { nd.stop(sig) })
	}
	wg.Wait()
	if empty {
		for _, nd := range h.nats.nodes {
			if err := os.RemoveAll(filepath.Join(nd.dir, "store")); err != nil {
				h.t.Errorf("empty the store of nats %s: %v", nd.name, err)
			}
		}
	}
	sleepCtx(ctx, clusterDown)
	heal := context.WithoutCancel(ctx)
	for _, nd := range h.nats.nodes {
		if err := nd.start(); err != nil {
			h.t.Errorf("restart nats %s: %v", nd.name, err)
		}
	}
	note := "restarted; "
	if empty {
		note = "restarted empty; "
	}
	h.healed(f, note+h.healthy(heal))
}

// partitionLane cuts one shop process off every node (all its proxies
// paused) for partitionFor, a different process each time.
func (h *harness) partitionLane(ctx context.Context) {
	end, _ := ctx.Deadline()
	if !sleepCtx(ctx, 12*time.Second) {
		return
	}
	for i := 0; time.Until(end) >= partitionFor+3*time.Second; i++ {
		s := h.slots[(3*i+1)%len(h.slots)]
		s.mu.Lock()
		s.partitioned = true
		s.mu.Unlock()
		f := h.begin(KindPartition, s.name)
		for _, p := range s.proxies {
			p.Pause()
		}
		sleepCtx(ctx, partitionFor)
		for _, p := range s.proxies {
			p.Resume()
		}
		s.mu.Lock()
		s.partitioned = false
		s.mu.Unlock()
		h.healed(f, "proxies resumed")
		if !sleepCtx(ctx, 15*time.Second) {
			return
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
