package chaos

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/ops/verify"
)

// verify runs the checks of `shop verify` until they pass, for a minute at
// most, also while the database refuses connections (a shared server that
// is full).
func (h *harness) verify(ctx context.Context) (verify.Report, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		report, err := verify.Wait(ctx, h.shop, app.OutboxRetention, time.Until(deadline))
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
	d.mu.Lock()
	res.RefusedPays = append([]string(nil), d.refusedPays...)
	d.mu.Unlock()
	h.mu.Lock()
	res.Fired = maps.Clone(h.fired)
	for _, v := range h.dups {
		res.Duplicates += int64(v)
	}
	res.Killed = int64(len(h.kills))
	res.RelayKills = h.relayKills.Load()
	res.Faults = h.faultsCopy()
	res.SelfExits = append([]Exit(nil), h.exits...)
	res.PeakConns, res.PeakServerConns = h.peakConns, h.peakServerConns
	h.mu.Unlock()
	for _, n := range h.cfg.failpoints() {
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
	if h.cfg.lane(LaneCDC) {
		if res.Slots, err = h.readSlots(ctx); err != nil {
			h.t.Errorf("%v", err)
		}
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
	if len(r.NotFired) > 0 && h.cfg.lane(LaneProcess) {
		t.Errorf("failpoints that never fired: %v", r.NotFired)
	}
	if r.Unended > 0 {
		t.Errorf("%d orders' sagas had not ended after the bounded wait", r.Unended)
	}
	if n := len(r.RefusedPays); n > 0 {
		t.Errorf("%d payments made the moment their order said WAIT_PAY were refused, e.g. %s", n, r.RefusedPays[0])
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
	if h.cfg.lane(LaneHostile) && (r.Hostile.Early == 0 || r.Hostile.Garbage == 0) {
		t.Errorf("the hostile lane sent %+v: no early events or no garbage (chaos too short?)", r.Hostile)
	}
	if r.PermissionViolations > 0 {
		t.Errorf("the shop processes logged %d NATS permissions violations: a service needs what its user may not do (broker.Permissions)", r.PermissionViolations)
	}
	if r.StreamLoss.After > 0 {
		t.Errorf("%d acked events still missing from their streams after the repair: %v", r.StreamLoss.After, r.StreamLoss.Notes)
	}
	if h.cfg.lane(LaneCDC) {
		if want := RelayKillsWanted(h.cfg.Duration); r.RelayKills < want {
			t.Errorf("the cdc lane killed %d streaming relays, want at least %d", r.RelayKills, want)
		}
		for _, k := range []string{KindSlotDrop, KindPGRestart} {
			if r.FaultCounts[k] == 0 {
				t.Errorf("the cdc lane injected no %s (chaos too short?)", k)
			}
		}
		for _, s := range r.Slots {
			if !s.Exists || (s.WALStatus != "reserved" && s.WALStatus != "extended") {
				t.Errorf("after the run, slot %+v: want it kept, its WAL reserved", s)
			}
		}
	}
	if r.Nodes > 1 && h.cfg.lane(LaneBroker) {
		for _, k := range []string{KindLeaderKill, KindEmptyRestart, KindQuorumLoss} {
			if r.FaultCounts[k] == 0 {
				t.Errorf("the run injected no %s (chaos too short?)", k)
			}
		}
	}
}

// deadEvents counts the events any outbox gave up on (dead_at set), with
// the first error of each service that has some.
func (h *harness) deadEvents(ctx context.Context) (int, []string, error) {
	total, notes := 0, []string(nil)
	for _, name := range h.cfg.Services.Names() {
		var n int
		var sample string
		err := h.admin.QueryRow(ctx, `SELECT count(*), coalesce(min(event_type || ': ' || coalesce(last_error, '')), '') FROM `+
			h.schema(name)+`.outbox WHERE dead_at IS NOT NULL`).Scan(&n, &sample)
		if err != nil {
			return 0, nil, fmt.Errorf("count dead events of %s: %w", name, err)
		}
		if n > 0 {
			notes = append(notes, fmt.Sprintf("%s: %d dead, e.g. %s", name, n, sample))
		}
		total += n
	}
	return total, notes, nil
}

func (h *harness) scrapeLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		h.scrapeAll()
		var mine, all int
		if h.admin.QueryRow(ctx, `SELECT count(*) FILTER (WHERE datname = $1), count(*) FROM pg_stat_activity
			WHERE backend_type = 'client backend'`, h.dbName).Scan(&mine, &all) == nil {
			h.mu.Lock()
			h.peakConns, h.peakServerConns = max(h.peakConns, mine), max(h.peakServerConns, all)
			h.mu.Unlock()
		}
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
	for _, name := range h.cfg.Services.Names() {
		var n int64
		s := h.schema(name)
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
		err := h.admin.QueryRow(ctx, `SELECT count(*) FROM `+h.schema("order")+
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

func secs(d time.Duration) string { return fmt.Sprintf("%.1fs", d.Seconds()) }

func (h *harness) table(r Result) {
	out := h.cfg.Out
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "scenario\torders\tevents published\tduplicates absorbed\tprocesses killed\tfailpoints fired\tviolations\tfinal status\t")
	for _, s := range r.Scenarios {
		fmt.Fprintf(w, "%s\t%d\t-\t-\t-\t-\t-\t%s\t\n", s.Name, s.Orders, statusList(s.Final))
	}
	fmt.Fprintf(w, "all (%v of chaos)\t%d\t%d\t%d\t%d\t%d/%d\t%d\t%d unended\t\n", h.cfg.Duration,
		r.Orders, r.EventsPublished, r.Duplicates, r.Killed, len(h.cfg.failpoints())-len(r.NotFired), len(h.cfg.failpoints()), r.Violations, r.Unended)
	w.Flush()

	fmt.Fprintf(out, "\nbroker faults on %d NATS node(s), offsets from the start of the chaos; stall: see chaos.Stall\n", r.Nodes)
	w = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "fault\ttarget\tstart\theal\twindow end\tlongest stall\tstall from–to\tlongest order wait\tnote\toverlapping faults")
	for i, f := range r.Faults {
		st := r.Stalls[i]
		d := secs(st.D)
		if st.Open {
			d = "≥" + d
		}
		span := "-"
		if st.D > 0 {
			span = fmt.Sprintf("%v–%v", h.offset(st.From), h.offset(st.To))
		}
		fmt.Fprintf(w, "%s\t%s\t%v\t%v\t%v\t%s\t%s\t%s\t%s\t%s\n", f.Kind, f.Target, h.offset(f.Start), h.offset(f.Heal),
			h.offset(st.Until), d, span, secs(st.OrderWait), f.Note, overlaps(r.Faults, r.Stalls, i))
	}
	w.Flush()

	kinds := []string{KindLeaderKill, KindEmptyRestart, KindQuorumLoss, KindPartition, KindJetStreamOff, KindConsumerDelete, KindClusterRestart, KindConnReset,
		KindSlotDrop, KindPGRestart}
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		parts = append(parts, fmt.Sprintf("%s×%d", k, r.FaultCounts[k]))
	}
	fmt.Fprintf(out, "\nfaults injected: %s; process SIGKILLs %d (of streaming relays %d), failpoint crashes %d, Postgres backends terminated %d\n",
		strings.Join(parts, ", "), r.Killed, r.RelayKills, r.Crashes, r.Terminated)
	for _, s := range r.Slots {
		fmt.Fprintf(out, "slot %s at the end: wal_status %s, active %v, lag %d bytes\n", s.Slot, s.WALStatus, s.Active, s.LagBytes)
	}
	names := h.cfg.failpoints()
	parts = parts[:0]
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s×%d", n, r.Fired[n]))
	}
	fmt.Fprintf(out, "failpoints: %s\n", strings.Join(parts, ", "))
	h.writeRedelivery(out, r.Redelivery)
	hs := r.Hostile
	fmt.Fprintf(out, "hostile peer (publishing into ORDERS as a buggy producer could): sent %d early, %d conflicting, %d oversized, %d garbage "+
		"(%d more not acked during broker faults); the shop parked %d, dead-lettered %d (%d as conflicts), all discarded by the operator before verify\n",
		hs.Early, hs.Conflicting, hs.Oversized, hs.Garbage, hs.Refused, hs.Parked, hs.DeadLetters, hs.Conflicts)
	server := "shared with other tests"
	if h.pg != nil {
		server = "the cdc lane's private cluster"
	}
	fmt.Fprintf(out, "peak Postgres client connections: %d to the run's database, %d to the whole server (%s)\n",
		r.PeakConns, r.PeakServerConns, server)

	w = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "\ntarget\tfound\twant\t")
	fmt.Fprintf(w, "shop processes that exited on their own\t%d\t0\t\n", len(r.SelfExits))
	if n := pgFull(r.SelfExits); n > 0 {
		// Not a broker fault's doing: the Postgres server (100 connections,
		// shared with whatever else runs on the machine) refused them.
		fmt.Fprintf(w, "  of which Postgres refused a connection (too many clients, SQLSTATE 53300)\t%d\t\t\n", n)
	}
	fmt.Fprintf(w, "NATS nodes that exited on their own\t%d\t0\t\n", len(r.NodeExits))
	fmt.Fprintf(w, "dead events in the outboxes\t%d\t0\t\n", r.DeadEvents)
	fmt.Fprintf(w, "acked events missing from streams, before the repair\t%d\t\t\n", r.StreamLoss.Before)
	fmt.Fprintf(w, "acked events missing from streams, after the repair\t%d\t0\t\n", r.StreamLoss.After)
	fmt.Fprintf(w, "NATS permissions violations logged by the shop\t%d\t0\t\n", r.PermissionViolations)
	if h.cfg.lane(LaneCDC) {
		fmt.Fprintf(w, "streaming relays SIGKILLed (cdc lane)\t%d\t≥%d\t\n", r.RelayKills, RelayKillsWanted(h.cfg.Duration))
	}
	fmt.Fprintf(w, "invariant violations\t%d\t0\t\n", r.Violations)
	fmt.Fprintf(w, "sagas not ended\t%d\t0\t\n", r.Unended)
	fmt.Fprintf(w, "payments refused the moment their order said WAIT_PAY\t%d\t0\t\n", len(r.RefusedPays))
	w.Flush()
	fmt.Fprintf(out, "wall time %v\n", r.Elapsed.Round(time.Second))
	for _, n := range r.DeadNotes {
		fmt.Fprintf(out, "dead: %s\n", n)
	}
	for _, n := range r.StreamLoss.Notes {
		fmt.Fprintf(out, "lost from a stream: %s\n", n)
	}
	writeExits(out, "shop processes", r.SelfExits, h.offset)
	writeExits(out, "NATS nodes", r.NodeExits, h.offset)
	r.Report.Write(out)
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
