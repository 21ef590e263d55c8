package reconcile

import (
	"fmt"
	"io"

	"github.com/shop-ref/shop/ops/verify"
)

// Kind is what a finding is about.
type Kind string

// The kinds of findings.
const (
	// StuckOrder: PENDING longer than Config.Pending, PAID or FULFILLING
	// longer than Config.Paid, WAIT_PAY past its payment timeout plus
	// Config.Grace.
	StuckOrder Kind = "stuck_order"
	// UnrefundedPayment: a succeeded payment, older than Config.Grace, for
	// an order that it did not pay (the order is not PAID, FULFILLING or
	// COMPLETED, or another payment paid it) and that payment has no
	// refund for; or a rejected payment (rejected.go) not refunded within
	// Config.Grace.
	UnrefundedPayment Kind = "unrefunded_payment"
	// HeldReservation: inventory holds stock (RESERVED) for an order whose
	// saga ended (REJECTED, CLOSED, COMPLETED) more than Config.Grace ago.
	HeldReservation Kind = "held_reservation"
	// LostEvent: an event its outbox marked published within
	// Config.Retention that its service's stream no longer holds (only
	// with Config.JetStream).
	LostEvent Kind = "lost_event"
)

// Kinds lists every Kind, in report order.
var Kinds = []Kind{StuckOrder, UnrefundedPayment, HeldReservation, LostEvent}

// Finding is one thing the reconciler found.
type Finding struct {
	Kind    Kind
	OrderID string // the order concerned; for a LostEvent, its aggregate's id when that is an order, else ""
	Detail  string // e.g. "PENDING for 12m0s"
	// Event is the lost event of a LostEvent finding (nil for the others).
	Event *verify.Lost
	// Republished counts the events republished for this order by this run
	// (0: nothing was lost in transit, or repairs were off: report only);
	// for a LostEvent, 1 when its event was republished.
	Republished int
}

func (f Finding) String() string {
	if f.Event != nil {
		s := fmt.Sprintf("%s %s", f.Kind, f.Event)
		if f.Republished > 0 {
			s += " (republished)"
		}
		return s
	}
	s := fmt.Sprintf("%s order %s: %s", f.Kind, f.OrderID, f.Detail)
	if f.Republished > 0 {
		s += fmt.Sprintf(" (republished %d lost events)", f.Republished)
	}
	return s
}

// Counts summarises a run, for metrics.
type Counts struct {
	StuckOrders        int
	UnrefundedPayments int
	HeldReservations   int
	LostEvents         int // published events their stream no longer holds
	Republished        int // events republished by the run, lost ones included
	Requeued           int // dead events put back: they had died of a missing stream
}

// Of returns the count of one kind.
func (c Counts) Of(k Kind) int {
	switch k {
	case StuckOrder:
		return c.StuckOrders
	case UnrefundedPayment:
		return c.UnrefundedPayments
	case HeldReservation:
		return c.HeldReservations
	case LostEvent:
		return c.LostEvents
	}
	return 0
}

// Report is the outcome of Run.
type Report struct {
	Findings []Finding
	Counts   Counts
	// Audits are the stream audits of the run (with Config.JetStream): a
	// stream whose audit has an Err was not checked, and lost events in
	// it were neither found nor repaired.
	Audits []verify.StreamAudit
	// Requeued are the dead events the run put back (with Config.Repair):
	// they had died of a missing stream, the broker's loss.
	Requeued []Requeued
}

// Write prints the report, one line per finding and per stream that could
// not be audited.
func (r Report) Write(w io.Writer) {
	for _, f := range r.Findings {
		fmt.Fprintf(w, "RECONCILE %s\n", f)
	}
	for _, q := range r.Requeued {
		fmt.Fprintf(w, "RECONCILE requeued %s event %s (%s of %s): it had died of a missing stream\n", q.Service, q.EventID, q.Type, q.AggregateID)
	}
	for _, a := range r.Audits {
		if a.Err != nil {
			fmt.Fprintf(w, "RECONCILE stream %s of %s not audited: %v\n", a.Stream, a.Service, a.Err)
		}
		if a.Older > 0 {
			fmt.Fprintf(w, "RECONCILE stream %s of %s: audited its newest %d events, not %d older ones (shop outbox republish --lost audits them all)\n",
				a.Stream, a.Service, a.Published, a.Older)
		}
	}
	fmt.Fprintf(w, "reconcile: %d stuck orders, %d unrefunded payments, %d held reservations, %d lost events; %d events republished, %d dead events requeued\n",
		r.Counts.StuckOrders, r.Counts.UnrefundedPayments, r.Counts.HeldReservations, r.Counts.LostEvents, r.Counts.Republished, r.Counts.Requeued)
}
