// Package verify checks the contract's end-to-end invariants against the
// live schemas of the four services (`shop verify`). It only reads.
//
// It is an operator's tool, so unlike the services it reads every schema;
// the services themselves never read each other's tables.
//
// Outbox rows are deleted some time after they are published (the relay's
// Retention), so the checks that pair business rows with their events look
// only at what is younger than that window.
//
// The consumers' inboxes tell only what reached them: an event the broker
// acknowledged and then lost, before any consumer read it, leaves no trace
// in any schema. WithStreams adds the audit of the streams themselves
// (AuditStreams), which needs the NATS server.
package verify

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
)

// Check is one invariant check and what it found.
type Check struct {
	Invariant  int    // 1–4, as numbered in the contract
	Name       string // what was checked
	Violations []string
}

// Report is the outcome of Run.
type Report struct{ Checks []Check }

// OK tells whether every check passed.
func (r Report) OK() bool {
	for _, c := range r.Checks {
		if len(c.Violations) > 0 {
			return false
		}
	}
	return true
}

// Violations counts what failed.
func (r Report) Violations() int {
	n := 0
	for _, c := range r.Checks {
		n += len(c.Violations)
	}
	return n
}

// Write prints the report, one line per check and one per violation (at
// most 20 per check).
func (r Report) Write(w io.Writer) {
	for _, c := range r.Checks {
		mark := "ok  "
		if len(c.Violations) > 0 {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "%s invariant %d: %s\n", mark, c.Invariant, c.Name)
		for i, v := range c.Violations {
			if i == 20 {
				fmt.Fprintf(w, "       … and %d more\n", len(c.Violations)-20)
				break
			}
			fmt.Fprintf(w, "       %s\n", v)
		}
	}
	if r.OK() {
		fmt.Fprintln(w, "all invariants hold")
	} else {
		fmt.Fprintf(w, "%d violations\n", r.Violations())
	}
}

// Pools are the services' database pools, each bound to its schema.
type Pools struct{ Order, Inventory, Payment, Fulfillment *pgxpool.Pool }

// Of is service's pool. An unknown service, or one without a pool, is an
// error: a check must never quietly read another service's tables.
func (p Pools) Of(service string) (*pgxpool.Pool, error) {
	var pool *pgxpool.Pool
	switch service {
	case "order":
		pool = p.Order
	case "inventory":
		pool = p.Inventory
	case "payment":
		pool = p.Payment
	case "fulfillment":
		pool = p.Fulfillment
	default:
		return nil, fmt.Errorf("no pool for unknown service %q: add it to verify.Pools", service)
	}
	if pool == nil {
		return nil, fmt.Errorf("no pool for service %q", service)
	}
	return pool, nil
}

// consumers are the durable consumers of docs/events.md: who reads whose
// stream, and which event types a consumer filters on (nil: all of them).
var consumers = []struct {
	name, service, producer string
	types                   []string
}{
	{"order-inventory", "order", "inventory", nil},
	{"order-payment", "order", "payment", nil},
	{"order-fulfillment", "order", "fulfillment", nil},
	{"inventory-orders", "inventory", "order", nil},
	{"payment-orders", "payment", "order", nil},
	{"fulfillment-orders", "fulfillment", "order", []string{"OrderPaid"}},
}

// ConsumedTypes returns the event types consumer filters on, nil when it
// reads every event of its stream.
func ConsumedTypes(consumer string) []string {
	for _, c := range consumers {
		if c.name == consumer {
			return c.types
		}
	}
	return nil
}

var services = []string{"order", "inventory", "payment", "fulfillment"}

// Option adds to what Run and Wait check.
type Option func(*options)

type options struct {
	js jetstream.JetStream
}

// parkedTooLong is how long an event may wait in an inbox's parking lot
// before verify reports it: the predecessor it waits for comes within
// seconds when the shop works (a relay retry, a redelivery), so minutes
// mean it is not coming by itself.
const parkedTooLong = 5 * time.Minute

// WithStreams adds invariant 3 as the broker sees it: every event an
// outbox marked published within the retention is still held by its
// service's stream on js (AuditStreams, whose doc says what it reads and
// costs). A lost event is a violation naming service, event id, aggregate
// and sequence; a stream that cannot be read (NATS unreachable, no such
// stream) is a violation too, never a pass.
func WithStreams(js jetstream.JetStream) Option { return func(o *options) { o.js = js } }

// Run runs every check once. retention is the relay's outbox retention:
// business rows older than it may have lost their (published) events.
func Run(ctx context.Context, pools Pools, retention time.Duration, opts ...Option) (Report, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	v := &run{ctx: ctx, pools: pools, since: time.Now().Add(-retention)}
	v.intents()
	v.delivery()
	if o.js != nil && v.err == nil {
		v.streams(o.js, retention)
	}
	v.effects()
	v.rejectedPayments()
	if v.err != nil {
		return Report{}, v.err
	}
	return Report{Checks: v.checks}, nil
}

// Wait runs the checks until they pass or timeout passes, and returns the
// last report: right after a run of traffic, events are still in flight.
func Wait(ctx context.Context, pools Pools, retention, timeout time.Duration, opts ...Option) (Report, error) {
	deadline := time.Now().Add(timeout)
	for {
		r, err := Run(ctx, pools, retention, opts...)
		if err != nil || r.OK() || time.Now().After(deadline) {
			return r, err
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

type run struct {
	ctx    context.Context
	pools  Pools
	since  time.Time
	checks []Check
	err    error
}

// rows runs a query whose rows each describe one violation (one text column).
func (v *run) rows(service, sql string, args ...any) []string {
	if v.err != nil {
		return nil
	}
	pool, err := v.pools.Of(service)
	if err != nil {
		v.err = err
		return nil
	}
	rows, err := pool.Query(v.ctx, sql, args...)
	if err != nil {
		v.err = fmt.Errorf("%s: %w", service, err)
		return nil
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		v.err = fmt.Errorf("%s: %w", service, err)
	}
	return out
}

func (v *run) check(inv int, name string, violations ...[]string) {
	var all []string
	for _, vs := range violations {
		all = append(all, vs...)
	}
	v.checks = append(v.checks, Check{Invariant: inv, Name: name, Violations: all})
}

// pair compares, per key, how many business facts there are with how many
// events of one type: invariant 1 when facts lack events (or have several),
// invariant 2 when events have no fact (an intent without a committed change).
func (v *run) pair(service, what, facts, eventType, eventKey string) {
	q := `
		WITH facts AS (` + facts + `),
		     events AS (SELECT ` + eventKey + ` AS key, count(*) AS n FROM outbox
		                WHERE event_type = $2 AND occurred_at > $1 GROUP BY 1)
		SELECT CASE WHEN f.key IS NULL THEN 'orphan:' ELSE 'missing:' END ||
		       coalesce(f.key, e.key) || ' has ' || coalesce(f.n, 0) || ' ' || $3 || ' and ' ||
		       coalesce(e.n, 0) || ' ' || $2 || ' events'
		FROM facts f FULL JOIN events e ON e.key = f.key
		WHERE coalesce(f.n, 0) <> coalesce(e.n, 0)`
	found := v.rows(service, q, v.since, eventType, what)
	var missing, orphans []string
	for _, f := range found {
		if rest, ok := strings.CutPrefix(f, "orphan:"); ok {
			orphans = append(orphans, service+": "+rest)
		} else {
			missing = append(missing, service+": "+strings.TrimPrefix(f, "missing:"))
		}
	}
	v.check(1, fmt.Sprintf("%s: each %s has exactly one %s", service, what, eventType), missing)
	v.check(2, fmt.Sprintf("%s: each %s event has a committed %s", service, eventType, what), orphans)
}

// intents checks invariants 1 and 2: committed changes and event intents
// correspond one to one, and sequences have no gaps.
func (v *run) intents() {
	since := `created_at > $1`
	v.pair("order", "order", `SELECT order_id::text AS key, 1 AS n FROM orders WHERE `+since, "OrderCreated", "aggregate_id")
	for status, event := range map[string]string{
		"WAIT_PAY": "OrderAwaitingPayment", "REJECTED": "OrderRejected", "PAID": "OrderPaid",
		"CLOSED": "OrderClosed", "COMPLETED": "OrderCompleted",
	} {
		v.pair("order", "transition to "+status,
			// Entries that repeat the previous status (a refund noted in
			// the history) are no transitions.
			`SELECT order_id::text AS key, count(*) AS n FROM (
				SELECT order_id, status, at, lag(status) OVER (PARTITION BY order_id ORDER BY id) AS before
				FROM order_history) h
			 WHERE status = '`+status+`' AND before IS DISTINCT FROM status AND at > $1 GROUP BY 1`,
			event, "aggregate_id")
	}
	v.pair("inventory", "reservation", `SELECT order_id AS key, 1 AS n FROM reservations
		WHERE created_at > $1 GROUP BY 1`, "InventoryReserved", "aggregate_id")
	v.pair("inventory", "release", `SELECT order_id AS key, 1 AS n FROM reservations
		WHERE state = 'RELEASED' AND updated_at > $1 GROUP BY 1`, "InventoryReleased", "aggregate_id")
	v.pair("inventory", "sale", `SELECT order_id AS key, 1 AS n FROM reservations
		WHERE state = 'COMMITTED' AND updated_at > $1 GROUP BY 1`, "InventoryCommitted", "aggregate_id")
	v.pair("payment", "succeeded payment", `SELECT payment_id::text AS key, 1 AS n FROM payments
		WHERE status = 'succeeded' AND created_at > $1`, "PaymentSucceeded", "payload->>'payment_id'")
	v.pair("payment", "failed payment", `SELECT payment_id::text AS key, 1 AS n FROM payments
		WHERE status = 'failed' AND created_at > $1`, "PaymentFailed", "payload->>'payment_id'")
	v.pair("payment", "refund", `SELECT refund_id::text AS key, 1 AS n FROM refunds
		WHERE state = 'DONE' AND updated_at > $1`, "PaymentRefunded", "payload->>'refund_id'")
	v.pair("fulfillment", "shipment", `SELECT order_id::text AS key, 1 AS n FROM shipments
		WHERE started_at > $1`, "FulfillmentStarted", "aggregate_id")
	v.pair("fulfillment", "delivery", `SELECT order_id::text AS key, 1 AS n FROM shipments
		WHERE state = 'DELIVERED' AND delivered_at > $1`, "ShipmentDelivered", "aggregate_id")

	for _, s := range services {
		v.check(2, s+": every aggregate's sequence is gap-free", v.rows(s, `
			SELECT aggregate_type || ' ' || aggregate_id || ': ' || count(*) || ' events numbered '
			       || min(aggregate_seq) || '…' || max(aggregate_seq)
			FROM outbox GROUP BY aggregate_type, aggregate_id
			HAVING max(aggregate_seq) - min(aggregate_seq) + 1 <> count(*)
			    OR max(aggregate_seq) <> (SELECT last_seq FROM outbox_sequences q
			                              WHERE q.aggregate_type = outbox.aggregate_type
			                                AND q.aggregate_id = outbox.aggregate_id)`))
	}
}

// delivery checks invariant 3: every intent was published, and every
// consumer that reads its stream has processed it (only the types a
// consumer filters on, for one that filters).
func (v *run) delivery() {
	for _, s := range services {
		v.check(3, s+": every event intent is published", v.rows(s, `
			SELECT event_type || ' ' || event_id || CASE WHEN dead_at IS NOT NULL
			       THEN ' is dead: ' || coalesce(last_error, '') ELSE ' is not yet published' END
			FROM outbox WHERE published_at IS NULL ORDER BY event_id`))
		v.check(3, s+": no dead letters", v.rows(s, `
			SELECT consumer_name || ': ' || CASE WHEN conflict_with IS NOT NULL THEN 'CONFLICT ' ELSE '' END ||
			       subject || ': ' || error FROM dead_letters
			WHERE resolved_at IS NULL ORDER BY id`))
		// An event parked this long waits for an earlier one of its
		// aggregate that is not coming by itself: dead, lost or never
		// written (a forged message).
		v.check(3, s+": no event parked longer than "+parkedTooLong.String(), v.rows(s, `
			SELECT consumer_name || ': ' || subject || ' (event ' || event_id || ', seq ' || aggregate_seq ||
			       ') parked since ' || to_char(parked_at, 'YYYY-MM-DD"T"HH24:MI:SS') || ', waiting for an earlier event of ' ||
			       aggregate_id
			FROM inbox_parked WHERE discarded_at IS NULL AND parked_at < now() - $1 * interval '1 microsecond'
			ORDER BY parked_at`, parkedTooLong.Microseconds()))
	}
	for _, c := range consumers {
		if v.err != nil {
			return
		}
		published := v.rows(c.producer, `SELECT event_id::text FROM outbox
			WHERE published_at IS NOT NULL AND occurred_at > $1
			  AND ($2::text[] IS NULL OR event_type = ANY($2))`, v.since, c.types)
		processed := v.rows(c.service, `SELECT event_id::text FROM processed_events
			WHERE consumer_name = $1 AND event_id = ANY($2::uuid[])`, c.name, published)
		slices.Sort(processed)
		var missing []string
		for _, id := range published {
			if _, ok := slices.BinarySearch(processed, id); !ok {
				missing = append(missing, fmt.Sprintf("%s has not processed %s event %s", c.name, c.producer, id))
			}
		}
		v.check(3, fmt.Sprintf("%s processed every %s event", c.name, c.producer), missing)
	}
}

// streams checks invariant 3 against the brokers: AuditStreams.
func (v *run) streams(js jetstream.JetStream, retention time.Duration) {
	audits, err := AuditStreams(v.ctx, v.pools, js, AuditConfig{Window: retention})
	if err != nil {
		v.err = err
		return
	}
	for _, a := range audits {
		var found []string
		if a.Err != nil {
			found = append(found, fmt.Sprintf("%s: not audited (%d published events unchecked): %v", a.Service, a.Published, a.Err))
		}
		for _, l := range a.Lost {
			found = append(found, l.String())
		}
		v.check(3, fmt.Sprintf("%s: stream %s holds every event marked published", a.Service, a.Stream), found)
	}
}

// effects checks invariant 4: however often events were delivered, their
// effects happened once.
func (v *run) effects() {
	v.check(4, "inventory: stock is conserved (on_hand + sold = supplied, 0 ≤ reserved ≤ on_hand)", v.rows("inventory", `
		SELECT sku || ': on_hand ' || on_hand || ', reserved ' || reserved || ', sold ' || sold || ', supplied ' || supplied
		FROM stock WHERE on_hand + sold <> supplied OR reserved < 0 OR reserved > on_hand`))
	v.check(4, "inventory: reserved equals what open reservations hold", v.rows("inventory", `
		SELECT s.sku || ': reserved ' || s.reserved || ' but reservations hold ' || coalesce(h.held, 0)
		FROM stock s LEFT JOIN (SELECT sku, sum(quantity) AS held FROM reservations
		                        WHERE state = 'RESERVED' GROUP BY sku) h ON h.sku = s.sku
		WHERE s.reserved <> coalesce(h.held, 0)`))
	v.check(4, "payment: no order is charged twice", v.rows("payment", `
		SELECT p.order_id || ': ' || count(*) || ' succeeded payments, ' || count(r.refund_id) || ' refunded'
		FROM payments p LEFT JOIN refunds r ON r.payment_id = p.payment_id AND r.state = 'DONE'
		WHERE p.status = 'succeeded' GROUP BY p.order_id
		HAVING count(*) - count(r.refund_id) > 1`))

	if v.err != nil {
		return
	}
	// Orders whose saga has ended, from the order schema; what payment and
	// inventory hold for them, from theirs.
	ended := v.rows("order", `SELECT order_id::text FROM orders WHERE status IN ('REJECTED', 'CLOSED', 'COMPLETED')`)
	closed := v.rows("order", `SELECT order_id::text FROM orders WHERE status IN ('REJECTED', 'CLOSED')`)
	v.check(4, "inventory: orders whose saga has ended hold no reserved stock", v.rows("inventory", `
		SELECT order_id || ' still holds ' || quantity || ' of ' || sku FROM reservations
		WHERE state = 'RESERVED' AND order_id = ANY($1)`, ended))
	v.check(4, "payment: every closed-but-paid order has exactly one refund per payment", v.rows("payment", `
		SELECT p.order_id || ': payment ' || p.payment_id || ' has ' || count(r.refund_id) || ' completed refunds'
		FROM payments p LEFT JOIN refunds r ON r.payment_id = p.payment_id AND r.state = 'DONE'
		WHERE p.status = 'succeeded' AND p.order_id::text = ANY($1)
		GROUP BY p.order_id, p.payment_id HAVING count(r.refund_id) <> 1`, closed))
}
