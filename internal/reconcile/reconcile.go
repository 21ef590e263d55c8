// Package reconcile finds what retries cannot: orders stuck in one state far
// longer than the saga allows, payments captured for orders that are not
// paid by them and were never refunded, and stock still reserved for orders
// whose saga has ended. `shop all` runs it every minute (internal/app) and
// `shop verify -repair` runs it once.
//
// Like internal/verify it is an operator's tool: it reads every service's
// schema. It never edits a service's business tables. Its only repair is
// the one that is always safe: when an event about a stuck order was
// published by one service and the consumer that should have acted on it
// never processed it (the message was lost: a purged stream, a consumer
// recreated past it, a dead letter resolved by hand), the producer's outbox
// row is marked unpublished again (outbox.Republish), so the producer's own
// relay publishes the same immutable event, with the same id and
// Aggregate-Seq, once more. Consumers are idempotent by event id and
// sequence, so a copy of an event they did process changes nothing; one they
// missed takes the normal saga path. Events are republished in sequence
// order, so the relay's per-aggregate ordering holds for the copies too.
//
// With Config.JetStream it also audits every service's stream against its
// outbox (verify.AuditStreams): an event the outbox marked published that
// the stream no longer holds — acknowledged by the broker, then lost in an
// OS crash before its fsync, on a failed disk, or deleted by hand — reached
// no consumer that had not read it yet, and the relay never sends it again
// by itself. With Repair every such event is republished (outbox.RepublishAll,
// one statement per service): the relay sends the copies with their ids and
// sequences, in order per aggregate; a consumer that had applied the event
// absorbs the copy, one that had not applies it.
//
// Everything else is reported only, as log lines and counts (Counts), for a
// person to look at: an order whose events were all processed and that is
// still stuck has a bug or a stopped component (the saga timeout scanner,
// the refund loop) that republishing cannot fix, and an event already
// deleted by outbox retention cannot be republished.
package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/pkg/outbox"
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
}

// Write prints the report, one line per finding and per stream that could
// not be audited.
func (r Report) Write(w io.Writer) {
	for _, f := range r.Findings {
		fmt.Fprintf(w, "RECONCILE %s\n", f)
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
	fmt.Fprintf(w, "reconcile: %d stuck orders, %d unrefunded payments, %d held reservations, %d lost events; %d events republished\n",
		r.Counts.StuckOrders, r.Counts.UnrefundedPayments, r.Counts.HeldReservations, r.Counts.LostEvents, r.Counts.Republished)
}

// Config tunes what counts as stuck. Zero fields take the defaults beside
// them.
type Config struct {
	Pending        time.Duration // PENDING longer than this is stuck; default 5m
	Paid           time.Duration // PAID or FULFILLING longer than this is stuck; default 1h
	PaymentTimeout time.Duration // the order service's PAYMENT_TIMEOUT; default 15m
	Grace          time.Duration // slack past a deadline, and age before a payment or reservation counts; default 5m
	// RepublishAfter is how long ago an event must have been published (or
	// last republished) to be republished: longer than JetStream's
	// duplicate window, or the broker would drop the copy as a duplicate,
	// and it spaces repeated repairs of one order. Default
	// broker.DuplicateWindow + 1m.
	RepublishAfter time.Duration
	// Repair republishes lost events; false only reports.
	Repair bool
	// Limit bounds the orders repaired per run; default 100. Events a
	// stream lost are all republished, one statement per service.
	Limit int
	// JetStream, when set, adds the audit of every service's stream
	// against its outbox (LostEvent findings, verify.AuditStreams); nil
	// skips it.
	JetStream jetstream.JetStream
	// Retention is the relays' outbox retention: the stream audit looks
	// for the events published within it. Required with JetStream.
	Retention time.Duration
	// AuditNewest bounds the stream audit to the newest this many
	// published events of each service, so that a run every minute costs
	// about a second however long the retention and the traffic (`shop
	// outbox republish --lost` audits all of it); default 100,000.
	AuditNewest int
}

func (c *Config) setDefaults() {
	c.Pending = cmp.Or(c.Pending, 5*time.Minute)
	c.Paid = cmp.Or(c.Paid, time.Hour)
	c.PaymentTimeout = cmp.Or(c.PaymentTimeout, 15*time.Minute)
	c.Grace = cmp.Or(c.Grace, 5*time.Minute)
	c.RepublishAfter = cmp.Or(c.RepublishAfter, broker.DuplicateWindow+time.Minute)
	c.Limit = cmp.Or(c.Limit, 100)
	c.AuditNewest = cmp.Or(c.AuditNewest, 100_000)
}

// flows are the event flows about an order (docs/events.md): the producer
// whose outbox holds the event, and the consumer that must process it.
var flows = []struct{ producer, service, consumer string }{
	{"order", "inventory", "inventory-orders"},
	{"inventory", "order", "order-inventory"},
	{"order", "payment", "payment-orders"},
	{"payment", "order", "order-payment"},
	{"order", "fulfillment", "fulfillment-orders"},
	{"fulfillment", "order", "order-fulfillment"},
}

// Run finds stuck orders, unrefunded payments and held reservations once,
// with cfg.JetStream the events the streams lost, and, with cfg.Repair,
// republishes the events about them that were lost.
func Run(ctx context.Context, pools verify.Pools, cfg Config) (Report, error) {
	cfg.setDefaults()
	if cfg.JetStream != nil && cfg.Retention <= 0 {
		return Report{}, errors.New("reconcile: Config.JetStream without Config.Retention (the outbox retention)")
	}
	r := &run{ctx: ctx, pools: pools, cfg: cfg, repaired: map[string]int{}}
	if err := r.stuckOrders(); err != nil {
		return Report{}, err
	}
	if err := r.unrefundedPayments(); err != nil {
		return Report{}, err
	}
	if err := r.rejectedPayments(); err != nil {
		return Report{}, err
	}
	if err := r.heldReservations(); err != nil {
		return Report{}, err
	}
	if cfg.JetStream != nil {
		if err := r.lostEvents(); err != nil {
			return Report{}, err
		}
	}
	if cfg.Repair {
		// The streams' losses first: the per-order repair below then skips
		// the events they republished (no longer marked published).
		if err := r.repairLost(); err != nil {
			return r.report(), err
		}
		if err := r.repair(); err != nil {
			return r.report(), err
		}
	}
	return r.report(), nil
}

type run struct {
	ctx      context.Context
	pools    verify.Pools
	cfg      Config
	findings []Finding
	audits   []verify.StreamAudit
	repaired map[string]int // order id → events republished
	total    int
}

func (r *run) report() Report {
	rep := Report{Findings: r.findings, Audits: r.audits}
	for i := range rep.Findings {
		f := &rep.Findings[i]
		switch f.Kind {
		case StuckOrder:
			rep.Counts.StuckOrders++
		case UnrefundedPayment:
			rep.Counts.UnrefundedPayments++
		case HeldReservation:
			rep.Counts.HeldReservations++
		case LostEvent:
			rep.Counts.LostEvents++
		}
	}
	// One order may be found by several kinds; its repair is told once. A
	// lost event's finding tells its own.
	told := map[string]bool{}
	for i := range rep.Findings {
		f := &rep.Findings[i]
		if f.Kind == LostEvent {
			continue
		}
		if n := r.repaired[f.OrderID]; n > 0 && !told[f.OrderID] {
			f.Republished = n
			told[f.OrderID] = true
		}
	}
	rep.Counts.Republished = r.total
	return rep
}

func micros(d time.Duration) int64 { return d.Microseconds() }

// stuckOrders: each state's time is that of its first history entry (later
// entries with the same status are notes, e.g. a refund). WAIT_PAY's
// deadline is the earlier of its armed timeout and entry + PaymentTimeout
// (the pay-by the order promised): a timeout that fails keeps being
// rescheduled by the scanner, and an order whose timeout row is missing
// would wait forever.
func (r *run) stuckOrders() error {
	rows, err := r.pools.Order.Query(r.ctx, `
		WITH cur AS (
			SELECT o.order_id::text AS id, o.status,
			       coalesce((SELECT min(h.at) FROM order_history h
			                 WHERE h.order_id = o.order_id AND h.status = o.status), o.created_at) AS since,
			       t.due_at
			FROM orders o
			LEFT JOIN saga_timeouts t ON t.saga_id = o.order_id::text AND t.name = 'payment'
			WHERE o.status IN ('PENDING', 'WAIT_PAY', 'PAID', 'FULFILLING'))
		SELECT id, status, now() - since, due_at IS NOT NULL FROM cur
		WHERE (status = 'PENDING' AND since < now() - $1 * interval '1 microsecond')
		   OR (status IN ('PAID', 'FULFILLING') AND since < now() - $2 * interval '1 microsecond')
		   OR (status = 'WAIT_PAY' AND least(due_at, since + $3 * interval '1 microsecond')
		                               < now() - $4 * interval '1 microsecond')
		ORDER BY since`,
		micros(r.cfg.Pending), micros(r.cfg.Paid), micros(r.cfg.PaymentTimeout), micros(r.cfg.Grace))
	if err != nil {
		return fmt.Errorf("reconcile: stuck orders: %w", err)
	}
	var id, status string
	var age time.Duration
	var timeout bool
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &age, &timeout}, func() error {
		detail := fmt.Sprintf("%s for %s", status, age.Round(time.Second))
		if status == "WAIT_PAY" {
			if timeout {
				detail += ", its payment timeout has not closed it (is the saga timeout scanner running, or failing and rescheduling it?)"
			} else {
				detail += ", past its payment timeout, and no timeout is armed"
			}
		}
		r.findings = append(r.findings, Finding{Kind: StuckOrder, OrderID: id, Detail: detail})
		return nil
	})
	if err != nil {
		return fmt.Errorf("reconcile: stuck orders: %w", err)
	}
	return nil
}

// unrefundedPayments pairs payment's succeeded payments without a refund
// with what the order saga knows of them.
func (r *run) unrefundedPayments() error {
	type captured struct{ PaymentID, OrderID string }
	rows, err := r.pools.Payment.Query(r.ctx, `
		SELECT p.payment_id::text, p.order_id FROM payments p
		WHERE p.status = 'succeeded' AND p.created_at < now() - $1 * interval '1 microsecond'
		  AND NOT EXISTS (SELECT 1 FROM refunds f WHERE f.payment_id = p.payment_id)
		ORDER BY p.created_at`, micros(r.cfg.Grace))
	if err != nil {
		return fmt.Errorf("reconcile: payments: %w", err)
	}
	payments, err := pgx.CollectRows(rows, pgx.RowToStructByPos[captured])
	if err != nil || len(payments) == 0 {
		return wrap("payments", err)
	}
	ids := make([]string, 0, len(payments))
	for _, p := range payments {
		ids = append(ids, p.OrderID)
	}
	type order struct {
		ID, Status, PaidBy string
		Refunded           []string
	}
	rows, err = r.pools.Order.Query(r.ctx, `
		SELECT o.order_id::text, o.status, coalesce(s.data->>'payment_id', ''),
		       coalesce(ARRAY(SELECT jsonb_array_elements_text(s.data->'refunded')), '{}')
		FROM orders o LEFT JOIN saga_instances s ON s.id = o.order_id::text
		WHERE o.order_id::text = ANY($1)`, ids)
	if err != nil {
		return fmt.Errorf("reconcile: orders of payments: %w", err)
	}
	orders, err := pgx.CollectRows(rows, pgx.RowToStructByPos[order])
	if err != nil {
		return fmt.Errorf("reconcile: orders of payments: %w", err)
	}
	byID := map[string]order{}
	for _, o := range orders {
		byID[o.ID] = o
	}
	for _, p := range payments {
		o, ok := byID[p.OrderID]
		switch {
		case !ok:
			r.findings = append(r.findings, Finding{Kind: UnrefundedPayment, OrderID: p.OrderID,
				Detail: fmt.Sprintf("payment %s succeeded for an order the order service does not know", p.PaymentID)})
		case o.PaidBy == p.PaymentID && slices.Contains([]string{"PAID", "FULFILLING", "COMPLETED"}, o.Status):
			// The payment that paid the order: nothing to refund.
		case slices.Contains(o.Refunded, p.PaymentID):
			r.findings = append(r.findings, Finding{Kind: UnrefundedPayment, OrderID: p.OrderID,
				Detail: fmt.Sprintf("payment %s: the order (%s) requested its refund, payment never recorded it", p.PaymentID, o.Status)})
		default:
			r.findings = append(r.findings, Finding{Kind: UnrefundedPayment, OrderID: p.OrderID,
				Detail: fmt.Sprintf("payment %s succeeded, order is %s, no refund requested", p.PaymentID, o.Status)})
		}
	}
	return nil
}

// heldReservations pairs inventory's open reservations with ended orders.
func (r *run) heldReservations() error {
	rows, err := r.pools.Inventory.Query(r.ctx, `
		SELECT DISTINCT order_id FROM reservations WHERE state = 'RESERVED'`)
	if err != nil {
		return fmt.Errorf("reconcile: reservations: %w", err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(held) == 0 {
		return wrap("reservations", err)
	}
	rows, err = r.pools.Order.Query(r.ctx, `
		SELECT order_id::text, status, now() - updated_at FROM orders
		WHERE order_id::text = ANY($1) AND status IN ('REJECTED', 'CLOSED', 'COMPLETED')
		  AND updated_at < now() - $2 * interval '1 microsecond'
		ORDER BY updated_at`, held, micros(r.cfg.Grace))
	if err != nil {
		return fmt.Errorf("reconcile: orders of reservations: %w", err)
	}
	var id, status string
	var age time.Duration
	_, err = pgx.ForEachRow(rows, []any{&id, &status, &age}, func() error {
		r.findings = append(r.findings, Finding{Kind: HeldReservation, OrderID: id,
			Detail: fmt.Sprintf("stock still reserved, order %s for %s", status, age.Round(time.Second))})
		return nil
	})
	return wrap("orders of reservations", err)
}

func wrap(what string, err error) error {
	if err != nil {
		return fmt.Errorf("reconcile: %s: %w", what, err)
	}
	return nil
}

// lostEvents audits every stream against its outbox.
func (r *run) lostEvents() error {
	audits, err := verify.AuditStreams(r.ctx, r.pools, r.cfg.JetStream,
		verify.AuditConfig{Window: r.cfg.Retention, Newest: r.cfg.AuditNewest})
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	r.audits = audits
	for _, a := range audits {
		for _, l := range a.Lost {
			f := Finding{Kind: LostEvent, Event: &l, Detail: l.String()}
			if l.AggregateType == "order" {
				f.OrderID = l.AggregateID
			}
			r.findings = append(r.findings, f)
		}
	}
	return nil
}

// repairLost republishes every event a stream lost, one statement per
// service, so that service's relays see all of the copies or none.
func (r *run) repairLost() error {
	for _, service := range verify.Services() {
		var ids []uuid.UUID
		for _, f := range r.findings {
			if f.Event != nil && f.Event.Service == service {
				ids = append(ids, f.Event.EventID)
			}
		}
		if len(ids) == 0 {
			continue
		}
		pool, err := r.pools.Of(service)
		if err != nil {
			return fmt.Errorf("reconcile: %w", err)
		}
		marked, err := outbox.RepublishAll(r.ctx, pool, ids)
		if err != nil {
			return fmt.Errorf("reconcile: %s: %w", service, err)
		}
		for i := range r.findings {
			if f := &r.findings[i]; f.Event != nil && f.Event.Service == service && slices.Contains(marked, f.Event.EventID) {
				f.Republished = 1
			}
		}
		r.total += len(marked)
	}
	return nil
}

// repair republishes, for each order found (up to cfg.Limit), the events
// about it that one service published and the consumer that should have
// acted on them never processed.
func (r *run) repair() error {
	var orders []string
	for _, f := range r.findings {
		if f.Kind == LostEvent {
			continue // repaired by repairLost; the order need not be stuck
		}
		if !slices.Contains(orders, f.OrderID) {
			orders = append(orders, f.OrderID)
		}
	}
	if len(orders) > r.cfg.Limit {
		orders = orders[:r.cfg.Limit]
	}
	for _, id := range orders {
		for _, fl := range flows {
			n, err := r.republishLost(id, fl.producer, fl.service, fl.consumer)
			if err != nil {
				return err
			}
			r.repaired[id] += n
			r.total += n
		}
	}
	return nil
}

// republishLost republishes producer's published events of order id that
// consumer (in service's schema) has not processed, oldest first.
func (r *run) republishLost(id, producer, service, consumer string) (int, error) {
	producerPool, err := r.pools.Of(producer)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	servicePool, err := r.pools.Of(service)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %w", err)
	}
	rows, err := producerPool.Query(r.ctx, `
		SELECT event_id FROM outbox
		WHERE aggregate_type = 'order' AND aggregate_id = $1 AND dead_at IS NULL
		  AND published_at < now() - $2 * interval '1 microsecond'
		  AND ($3::text[] IS NULL OR event_type = ANY($3)) -- only what the consumer reads
		ORDER BY aggregate_seq`, id, micros(r.cfg.RepublishAfter), verify.ConsumedTypes(consumer))
	if err != nil {
		return 0, fmt.Errorf("reconcile: %s events of order %s: %w", producer, id, err)
	}
	published, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil || len(published) == 0 {
		return 0, wrap(producer+" events of order "+id, err)
	}
	// Handled: processed, or parked as an open dead letter (a copy would
	// only fail the same way and park again).
	rows, err = servicePool.Query(r.ctx, `
		SELECT event_id FROM processed_events WHERE consumer_name = $1 AND event_id = ANY($2)
		UNION
		SELECT event_id FROM dead_letters WHERE consumer_name = $1 AND event_id = ANY($2) AND resolved_at IS NULL`,
		consumer, published)
	if err != nil {
		return 0, fmt.Errorf("reconcile: %s processed events: %w", consumer, err)
	}
	processed, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return 0, fmt.Errorf("reconcile: %s processed events: %w", consumer, err)
	}
	n := 0
	// In sequence order: the relay publishes an event only when every
	// earlier one of its aggregate is published, so republishing seq 2
	// before seq 3 keeps their copies in order.
	for _, ev := range published {
		if slices.Contains(processed, ev) {
			continue
		}
		err := outbox.Republish(r.ctx, producerPool, ev)
		if errors.Is(err, outbox.ErrNotFound) {
			continue // republished meanwhile (another reconciler), or deleted by retention
		}
		if err != nil {
			return n, fmt.Errorf("reconcile: %w", err)
		}
		n++
	}
	return n, nil
}

// Job runs Run periodically and keeps the last run's counts for metrics.
type Job struct {
	Pools    verify.Pools
	Config   Config
	Interval time.Duration // default 1m
	Logger   *slog.Logger  // default slog.Default()

	last atomic.Pointer[Counts]
	runs atomic.Int64
}

// Last returns the counts of the last completed run (zero before the first)
// and how many runs completed.
func (j *Job) Last() (Counts, int64) {
	if c := j.last.Load(); c != nil {
		return *c, j.runs.Load()
	}
	return Counts{}, j.runs.Load()
}

// Run reconciles every Interval until ctx ends. A failed run is logged and
// retried at the next tick: the job never stops the process.
func (j *Job) Run(ctx context.Context) error {
	log := cmp.Or(j.Logger, slog.Default())
	t := time.NewTicker(cmp.Or(j.Interval, time.Minute))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if _, err := j.Once(ctx); err != nil && ctx.Err() == nil {
			log.Warn("reconcile failed", "err", err)
		}
	}
}

// Once runs the reconciler once, logs each finding and records the counts.
func (j *Job) Once(ctx context.Context) (Report, error) {
	log := cmp.Or(j.Logger, slog.Default())
	rep, err := Run(ctx, j.Pools, j.Config)
	if err != nil {
		return rep, err
	}
	for _, f := range rep.Findings {
		log.Warn("reconcile: "+string(f.Kind), "order_id", f.OrderID, "detail", f.Detail, "republished", f.Republished)
	}
	for _, a := range rep.Audits {
		if a.Err != nil {
			log.Warn("reconcile: stream not audited", "service", a.Service, "stream", a.Stream, "err", a.Err)
		}
	}
	c := rep.Counts
	j.last.Store(&c)
	j.runs.Add(1)
	return rep, nil
}
