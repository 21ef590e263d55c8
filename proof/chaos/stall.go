package chaos

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"
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
// longest part of the window one order spent waiting from a history entry
// to its next event-driven transition.
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
	case KindSlotDrop, KindPGRestart:
		return LaneCDC
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
			// The part of the wait inside the window.
			if d := minTime(w.ended, end).Sub(maxTime(w.created, f.Start)); d > out[i].OrderWait {
				out[i].OrderWait = d
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

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
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
		h.schema("order")+`.order_history ORDER BY order_id, id`)
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
