package chaos

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/migrations"
)

// stallAfter is how long after a fault heals its stall is still looked for.
const stallAfter = 60 * time.Second

// Stall is the longest saga stall after one broker fault: the longest
// interval within the fault's window in which no saga transition driven by
// an event committed while at least one order was in flight (created and
// not yet COMPLETED, CLOSED or REJECTED), counted from the first moment an
// order was. A transition driven by an event is every order_history entry
// after an order's first, except those the order service makes without the
// broker: a customer's cancel and a payment timeout. The window runs from
// the fault's start to its heal + stallAfter, cut short where the next
// fault of the same lane starts (so that one stall is not reported for two
// faults one after the other) and at the clean restart that ends the run;
// faults of the other lanes may overlap it, and the report names them.
//
// OrderWait is the same from one order's point of view, which a fault of
// one process (a partition) shows and the shop-wide stall does not: the
// longest time an order waited within the window, from a history entry
// made in it to its next event-driven transition (or the window's end).
type Stall struct {
	D         time.Duration
	From, To  time.Time
	Open      bool          // it lasted until the end of the window: at least D
	Until     time.Time     // the end of the window
	OrderWait time.Duration // the longest wait of one order
}

// laneOf is the lane (see harness.chaos) that injects faults of kind.
func laneOf(kind string) string {
	switch kind {
	case KindPartition:
		return "partition"
	case KindConnReset:
		return "process"
	}
	return "broker"
}

// stalls computes each fault's Stall; cleanRestart ends every window.
func (sp spans) stalls(faults []Fault, cleanRestart time.Time) []Stall {
	out := make([]Stall, len(faults))
	for i, f := range faults {
		end := f.Heal.Add(stallAfter)
		for _, g := range faults[i+1:] {
			if laneOf(g.Kind) == laneOf(f.Kind) {
				end = minTime(end, g.Start)
				break
			}
		}
		end = minTime(end, cleanRestart)
		out[i] = sp.stall(f.Start, end)
		out[i].Until = end
		for _, w := range sp.waits {
			if !w.created.Before(f.Start) && w.created.Before(end) {
				out[i].OrderWait = max(out[i].OrderWait, minTime(w.ended, end).Sub(w.created))
			}
		}
	}
	return out
}

// overlaps names the faults of other lanes active in the window of
// faults[i].
func overlaps(faults []Fault, stalls []Stall, i int) string {
	var names []string
	f := faults[i]
	for _, g := range faults {
		if laneOf(g.Kind) != laneOf(f.Kind) && g.Start.Before(stalls[i].Until) && !g.Heal.Before(f.Start) {
			names = append(names, g.Kind+" "+g.Target)
		}
	}
	return strings.Join(names, "; ")
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// spans are the orders' lives and the event-driven transitions, from
// order_history.
type spans struct {
	orders []span      // created … ended (zero: not ended)
	moves  []time.Time // event-driven transitions, sorted
	waits  []span      // an order's entry … its next event-driven transition
}

type span struct{ created, ended time.Time }

func (h *harness) history(ctx context.Context) (spans, error) {
	rows, err := h.admin.Query(ctx, `SELECT order_id::text, status, at, coalesce(reason, '') FROM `+
		pgx.Identifier{migrations.Schemas["order"]}.Sanitize()+`.order_history ORDER BY order_id, id`)
	if err != nil {
		return spans{}, fmt.Errorf("read order history: %w", err)
	}
	defer rows.Close()
	var sp spans
	var last string
	var prev time.Time // the order's previous entry
	for rows.Next() {
		var id, status, reason string
		var at time.Time
		if err := rows.Scan(&id, &status, &at, &reason); err != nil {
			return spans{}, fmt.Errorf("read order history: %w", err)
		}
		if id != last { // the order's first entry: it was created
			last, prev = id, at
			sp.orders = append(sp.orders, span{created: at})
			continue
		}
		o := &sp.orders[len(sp.orders)-1]
		if o.ended.IsZero() && (status == "COMPLETED" || status == "CLOSED" || status == "REJECTED") {
			o.ended = at
		}
		if reason != "customer_cancel" && reason != "payment_timeout" {
			sp.moves = append(sp.moves, at)
			sp.waits = append(sp.waits, span{created: prev, ended: at})
		}
		prev = at
	}
	slices.SortFunc(sp.moves, time.Time.Compare)
	return sp, rows.Err()
}

// firstInFlight is the earliest moment in [a, b) at which an order was in
// flight.
func (sp spans) firstInFlight(a, b time.Time) (time.Time, bool) {
	var first time.Time
	found := false
	for _, o := range sp.orders {
		if !o.created.Before(b) || (!o.ended.IsZero() && !o.ended.After(a)) {
			continue
		}
		s := o.created
		if s.Before(a) {
			s = a
		}
		if !found || s.Before(first) {
			first, found = s, true
		}
	}
	return first, found
}

// stall is the longest stall within [from, to] (see Stall).
func (sp spans) stall(from, to time.Time) Stall {
	var best Stall
	consider := func(a, b time.Time, open bool) {
		if s, ok := sp.firstInFlight(a, b); ok && b.Sub(s) > best.D {
			best = Stall{D: b.Sub(s), From: s, To: b, Open: open}
		}
	}
	prev := from
	i, _ := slices.BinarySearchFunc(sp.moves, from, time.Time.Compare)
	for ; i < len(sp.moves) && sp.moves[i].Before(to); i++ {
		consider(prev, sp.moves[i], false)
		prev = sp.moves[i]
	}
	consider(prev, to, true)
	return best
}

// consumersOf are each service's durable consumers and the producer whose
// outbox feeds them (docs/events.md).
var consumersOf = map[string][]struct{ name, producer string }{
	"order":       {{"order-inventory", "inventory"}, {"order-payment", "payment"}, {"order-fulfillment", "fulfillment"}},
	"inventory":   {{"inventory-orders", "order"}},
	"payment":     {{"payment-orders", "order"}},
	"fulfillment": {{"fulfillment-orders", "order"}},
}

// redeliveryWindow: the events whose delivery a SIGKILL may have cut short
// are those published in this long before it.
const redeliveryWindow = 2 * time.Second

// Redelivery is what one SIGKILL of a shop process cost its consumers.
type Redelivery struct {
	Slot   string
	At     time.Time
	D      time.Duration // the largest publish→processed delay (see harness.redelivery)
	During string        // the broker fault active at the kill that concerns its service, if any
}

// redelivery measures, for each SIGKILL of a shop process, the largest
// publish→processed delay (the consumer's processed_events.processed_at —
// its inbox transaction's start — minus the producer outbox's
// published_at, the relay's mark after the PubAck, joined by event id)
// among the events of the killed service's consumers published in the
// redeliveryWindow before the kill: an event the killed process had
// fetched and not acked waits for its redelivery, the others show the
// ordinary delay. Kills with no such event give no figure. A kill is
// during a broker fault when one was active (from redeliveryWindow before
// its start until its heal) and concerned the killed service: every fault
// but a partition or reset of another service's process.
func (h *harness) redelivery(ctx context.Context) ([]Redelivery, error) {
	h.mu.Lock()
	kills := slices.Clone(h.kills)
	faults := h.faultsCopy()
	h.mu.Unlock()
	var out []Redelivery
	for _, k := range kills {
		var worst *time.Duration
		for _, c := range consumersOf[k.service] {
			var secs *float64
			err := h.admin.QueryRow(ctx, `
				SELECT max(extract(epoch FROM p.processed_at - o.published_at))::float8
				FROM `+pgx.Identifier{migrations.Schemas[k.service]}.Sanitize()+`.processed_events p
				JOIN `+pgx.Identifier{migrations.Schemas[c.producer]}.Sanitize()+`.outbox o ON o.event_id = p.event_id
				WHERE p.consumer_name = $1 AND o.published_at BETWEEN $2::timestamptz - $3::interval AND $2`,
				c.name, k.at, redeliveryWindow.String()).Scan(&secs)
			if err != nil {
				return nil, fmt.Errorf("redelivery after killing %s: %w", k.slot, err)
			}
			if secs != nil {
				d := time.Duration(*secs * float64(time.Second))
				if worst == nil || d > *worst {
					worst = &d
				}
			}
		}
		if worst == nil {
			continue
		}
		r := Redelivery{Slot: k.slot, At: k.at, D: *worst}
		for _, f := range faults {
			local := laneOf(f.Kind) != "broker"
			if local && serviceOf(f.Target) != k.service {
				continue
			}
			if k.at.After(f.Start.Add(-redeliveryWindow)) && !k.at.After(f.Heal) {
				r.During = f.Kind + " " + f.Target
				break
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// serviceOf is the service of a slot's name (order-1: order).
func serviceOf(slot string) string {
	if i := strings.LastIndexByte(slot, '-'); i > 0 {
		return slot[:i]
	}
	return slot
}

// writeRedelivery prints p50 and max over every kill and over those
// outside broker faults, and the three worst.
func (h *harness) writeRedelivery(out io.Writer, rs []Redelivery) {
	fmt.Fprintf(out, "redelivery after a process kill (largest publish→processed delay of its consumers' events published %v before it): ",
		redeliveryWindow)
	if len(rs) == 0 {
		fmt.Fprintln(out, "no kill had events in flight")
		return
	}
	var all, clean []time.Duration
	for _, r := range rs {
		all = append(all, r.D)
		if r.During == "" {
			clean = append(clean, r.D)
		}
	}
	fmt.Fprintf(out, "p50 %s, max %s over %d kills; outside broker faults p50 %s, max %s over %d\n",
		secs(percentile(all, 50)), secs(percentile(all, 100)), len(all),
		secs(percentile(clean, 50)), secs(percentile(clean, 100)), len(clean))
	worst := slices.Clone(rs)
	slices.SortFunc(worst, func(a, b Redelivery) int { return cmp.Compare(b.D, a.D) })
	for _, r := range worst[:min(3, len(worst))] {
		during := cmp.Or(r.During, "no broker fault")
		fmt.Fprintf(out, "  %s killed at +%v: %s (%s)\n", r.Slot, h.offset(r.At), secs(r.D), during)
	}
}

// faultsCopy copies the faults; h.mu is held.
func (h *harness) faultsCopy() []Fault {
	out := make([]Fault, len(h.faults))
	for i, f := range h.faults {
		out[i] = *f
	}
	return out
}

// percentile is the p-th percentile (0–100, nearest rank) of ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// deadEvents counts the events any outbox gave up on (dead_at set), with
// the first error of each service that has some.
func (h *harness) deadEvents(ctx context.Context) (int, []string, error) {
	total, notes := 0, []string(nil)
	for _, name := range app.Names {
		var n int
		var sample string
		err := h.admin.QueryRow(ctx, `SELECT count(*), coalesce(min(event_type || ': ' || coalesce(last_error, '')), '') FROM `+
			pgx.Identifier{migrations.Schemas[name]}.Sanitize()+`.outbox WHERE dead_at IS NOT NULL`).Scan(&n, &sample)
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

func secs(d time.Duration) string { return fmt.Sprintf("%.1fs", d.Seconds()) }

func (h *harness) table(r Result) {
	out := h.cfg.Out
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "scenario\torders\tevents published\tduplicates absorbed\tprocesses killed\tfailpoints fired\tviolations\tfinal status\t")
	for _, s := range r.Scenarios {
		fmt.Fprintf(w, "%s\t%d\t-\t-\t-\t-\t-\t%s\t\n", s.Name, s.Orders, statusList(s.Final))
	}
	fmt.Fprintf(w, "all (%v of chaos)\t%d\t%d\t%d\t%d\t%d/%d\t%d\t%d unended\t\n", h.cfg.Duration,
		r.Orders, r.EventsPublished, r.Duplicates, r.Killed, len(failpoint.Names())-len(r.NotFired), len(failpoint.Names()), r.Violations, r.Unended)
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

	kinds := []string{KindLeaderKill, KindQuorumLoss, KindPartition, KindJetStreamOff, KindConsumerDelete, KindClusterRestart, KindConnReset}
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		parts = append(parts, fmt.Sprintf("%s×%d", k, r.FaultCounts[k]))
	}
	fmt.Fprintf(out, "\nfaults injected: %s; process SIGKILLs %d, failpoint crashes %d, Postgres backends terminated %d\n",
		strings.Join(parts, ", "), r.Killed, r.Crashes, r.Terminated)
	names := failpoint.Names()
	parts = parts[:0]
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s×%d", n, r.Fired[n]))
	}
	fmt.Fprintf(out, "failpoints: %s\n", strings.Join(parts, ", "))
	h.writeRedelivery(out, r.Redelivery)
	fmt.Fprintf(out, "peak Postgres client connections: %d to the run's database, %d to the whole server (shared with other tests)\n",
		r.PeakConns, r.PeakServerConns)

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
	fmt.Fprintf(w, "invariant violations\t%d\t0\t\n", r.Violations)
	fmt.Fprintf(w, "sagas not ended\t%d\t0\t\n", r.Unended)
	w.Flush()
	fmt.Fprintf(out, "wall time %v\n", r.Elapsed.Round(time.Second))
	for _, n := range r.DeadNotes {
		fmt.Fprintf(out, "dead: %s\n", n)
	}
	writeExits(out, "shop processes", r.SelfExits, h.offset)
	writeExits(out, "NATS nodes", r.NodeExits, h.offset)
	r.Report.Write(out)
}

// pgFull counts the exits whose cause is a Postgres server out of
// connections.
func pgFull(exits []Exit) int {
	n := 0
	for _, e := range exits {
		if strings.Contains(e.Cause(), "SQLSTATE 53300") {
			n++
		}
	}
	return n
}

// writeExits groups exits by their cause and prints, for each cause, who
// exited and the end of the first one's log.
func writeExits(out io.Writer, what string, exits []Exit, offset func(time.Time) time.Duration) {
	var causes []string
	by := map[string][]Exit{}
	for _, e := range exits {
		c := e.Cause()
		if by[c] == nil {
			causes = append(causes, c)
		}
		by[c] = append(by[c], e)
	}
	for _, c := range causes {
		es := by[c]
		who := make([]string, len(es))
		for i, e := range es {
			who[i] = fmt.Sprintf("%s#%d at +%v", e.Who, e.Gen, offset(e.At))
		}
		fmt.Fprintf(out, "\n%s that exited on their own ×%d with %q (%s): %s; the log of the first ends:\n%s\n",
			what, len(es), c, es[0].Status, strings.Join(who, ", "), es[0].Tail)
	}
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
