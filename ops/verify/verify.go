// Package verify checks the contract's end-to-end invariants against the
// live schemas of the shop's services (`shop verify`). It only reads.
//
// What it checks comes from the service registry (internal/registry): for
// every service, what the outbox and the inbox promise (every event intent
// published, sequences gap-free, no dead letters, nothing parked for long,
// every consumer has processed every event it reads) and the service's own
// Facts and Checks (each order has its OrderCreated, stock is conserved, no
// order is charged twice, …).
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
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Check is one invariant check and what it found.
type Check struct {
	Invariant  int    // 1–4, as numbered in docs/architecture.md, "The contract"
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

// Shop is what verify reads: the shop's services and a pool on each one's
// schema.
type Shop struct {
	Services registry.Registry
	Pools    map[string]*pgxpool.Pool // by service name, each on its service's schema
}

// Pool is service's pool. An unknown service, or one without a pool, is an
// error: a check must never quietly read another service's tables.
func (s Shop) Pool(service string) (*pgxpool.Pool, error) {
	if _, err := s.Services.Get(service); err != nil {
		return nil, err
	}
	pool := s.Pools[service]
	if pool == nil {
		return nil, fmt.Errorf("no pool for service %q", service)
	}
	return pool, nil
}

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

// retriedTooOften is how many failed attempts at one event a consumer may
// have made before verify reports it: an event that failed this often
// fails for a reason of its own, and the consumer will dead-letter it at
// its MaxDeliver; an operator wants to know before.
const retriedTooOften = 3

// slotLagTooOld is how long a service's replication slot may go without
// its relay having had everything confirmed before verify reports it: a
// streaming relay confirms within seconds, and an idle one's heartbeat
// records it caught up, so a minute means no relay streams the slot (all
// stopped, or every copy switched to poll) while it pins the server's WAL.
const slotLagTooOld = time.Minute

// WithStreams adds invariant 3 as the broker sees it: every event an
// outbox marked published within the retention is still held by its
// service's stream on js (AuditStreams, whose doc says what it reads and
// costs). A lost event is a violation naming service, event id, aggregate
// and sequence; a stream that cannot be read (NATS unreachable, no such
// stream) is a violation too, never a pass.
func WithStreams(js jetstream.JetStream) Option { return func(o *options) { o.js = js } }

// Run runs every check once. retention is the relay's outbox retention:
// business rows older than it may have lost their (published) events.
func Run(ctx context.Context, shop Shop, retention time.Duration, opts ...Option) (Report, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	v := &run{ctx: ctx, shop: shop, since: time.Now().Add(-retention)}
	v.intents()
	v.delivery()
	v.slots()
	if o.js != nil && v.err == nil {
		v.streams(o.js, retention)
	}
	v.checks()
	if v.err != nil {
		return Report{}, v.err
	}
	return Report{Checks: v.report}, nil
}

// Wait runs the checks until they pass or timeout passes, and returns the
// last report: right after a run of traffic, events are still in flight.
// A server that is there but cannot take the checks yet (out of
// connections, starting up) is waited for the same way; any other error
// ends the wait at once.
func Wait(ctx context.Context, shop Shop, retention, timeout time.Duration, opts ...Option) (Report, error) {
	deadline := time.Now().Add(timeout)
	for {
		r, err := Run(ctx, shop, retention, opts...)
		if (err != nil && !busy(err)) || (err == nil && r.OK()) || time.Now().After(deadline) {
			return r, err
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// busy reports whether err is a Postgres server that is there but cannot
// take the checks now: out of connections (class 53, "too many clients",
// when other clients fill max_connections) or starting up or shutting
// down (57P01–57P03). Waiting for the invariants includes waiting for such
// a server; one that cannot be reached at all, or refuses the login, ends
// the wait at once, for no wait will change it.
func busy(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "53") || slices.Contains([]string{"57P01", "57P02", "57P03"}, pgErr.Code)
}

type run struct {
	ctx    context.Context
	shop   Shop
	since  time.Time
	report []Check
	err    error
}

// rows runs a query whose rows each describe one violation (one text column).
func (v *run) rows(service, sql string, args ...any) []string {
	if v.err != nil {
		return nil
	}
	pool, err := v.shop.Pool(service)
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
	v.report = append(v.report, Check{Invariant: inv, Name: name, Violations: all})
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
// correspond one to one (each service's Facts), and sequences have no gaps.
func (v *run) intents() {
	for _, e := range v.shop.Services {
		for _, f := range e.Facts {
			v.pair(e.Name, f.What, f.SQL, f.EventType, f.EventKey)
		}
	}
	for _, e := range v.shop.Services {
		v.check(2, e.Name+": every aggregate's sequence is gap-free", v.rows(e.Name, `
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
	for _, e := range v.shop.Services {
		s := e.Name
		v.check(3, s+": every event intent is published", v.rows(s, `
			SELECT event_type || ' ' || event_id || CASE WHEN dead_at IS NOT NULL
			       THEN ' is dead: ' || coalesce(last_error, '') ELSE ' is not yet published' END
			FROM outbox WHERE published_at IS NULL ORDER BY event_id`))
		v.check(3, s+": no dead letters", v.rows(s, `
			SELECT consumer_name || ': ' || CASE WHEN conflict_with IS NOT NULL THEN 'CONFLICT ' ELSE '' END ||
			       subject || ': ' || error FROM dead_letters
			WHERE resolved_at IS NULL ORDER BY id`))
		v.check(3, fmt.Sprintf("%s: no event retried more than %d times", s, retriedTooOften), v.rows(s, `
			SELECT consumer_name || ': event ' || event_id || ' failed ' || attempts || ' times since ' ||
			       to_char(first_failed_at, 'YYYY-MM-DD"T"HH24:MI:SS') || ': ' || last_error
			FROM inbox_failures WHERE attempts > $1 ORDER BY first_failed_at`, retriedTooOften))
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
	for _, c := range v.shop.Services.Readers() {
		if v.err != nil {
			return
		}
		producer, _ := v.shop.Services.Owner(c.Stream) // Validate: every stream read has an owner
		published := v.rows(producer.Name, `SELECT event_id::text FROM outbox
			WHERE published_at IS NOT NULL AND occurred_at > $1
			  AND ($2::text[] IS NULL OR event_type = ANY($2))`, v.since, c.Types)
		processed := v.rows(c.Service, `SELECT event_id::text FROM processed_events
			WHERE consumer_name = $1 AND event_id = ANY($2::uuid[])`, c.Name, published)
		slices.Sort(processed)
		var missing []string
		for _, id := range published {
			if _, ok := slices.BinarySearch(processed, id); !ok {
				missing = append(missing, fmt.Sprintf("%s has not processed %s event %s", c.Name, producer.Name, id))
			}
		}
		v.check(3, fmt.Sprintf("%s processed every %s event", c.Name, producer.Name), missing)
	}
}

// slots checks the replication slot of each service that has one (a relay
// in cdc mode made it), as part of invariant 3: a slot whose WAL the server
// removed (wal_status lost) had its unconfirmed tail backfilled from the
// outbox only if a relay recreated it, and one no relay has confirmed for
// long pins WAL until the disk fills.
func (v *run) slots() {
	for _, e := range v.shop.Services {
		if v.err != nil {
			return
		}
		pool, err := v.shop.Pool(e.Name)
		if err != nil {
			v.err = err
			return
		}
		ss, err := outbox.ReadSlot(v.ctx, pool, "")
		if err != nil {
			v.err = fmt.Errorf("%s: %w", e.Name, err)
			return
		}
		if !ss.Exists {
			continue
		}
		var found []string
		if ss.WALStatus == "lost" {
			found = append(found, fmt.Sprintf("%s: slot %s wal_status lost: the server removed WAL it had not confirmed "+
				"(max_slot_wal_keep_size); a relay in cdc mode recreates it and backfills from the outbox table", e.Name, ss.Slot))
		}
		// Why nobody streams it, when the server says: the advice names
		// the setting or privilege. A server that could serve a relay
		// has none streaming: one left in poll mode, or all stopped.
		blockers, err := outbox.StreamBlockers(v.ctx, pool, ss.Slot)
		if err != nil {
			v.err = fmt.Errorf("%s: %w", e.Name, err)
			return
		}
		if ss.LagAge > slotLagTooOld {
			advice := fmt.Sprintf("no relay streams it: run the service with %s_RELAY_MODE=cdc, or, if it polls for good, drop the slot: %s",
				strings.ToUpper(e.Name), cli.DropSlotCommand(e.Name))
			if len(blockers) > 0 {
				advice = "no relay can stream it from this server: " + strings.Join(blockers, "; ")
			}
			found = append(found, fmt.Sprintf("%s: slot %s last caught up %s ago, %d bytes of WAL held: %s",
				e.Name, ss.Slot, ss.LagAge.Round(time.Second), ss.RestartLagBytes, advice))
		} else {
			// The one blocker that cannot wait for the slot to fall
			// behind: a wal_level change that keeps Postgres from starting.
			for _, b := range blockers {
				if strings.HasPrefix(b, "wal_level is changed") {
					found = append(found, fmt.Sprintf("%s: %s: %s", e.Name, b, cli.DropSlotCommand(e.Name)))
				}
			}
		}
		v.check(3, fmt.Sprintf("%s: replication slot %s keeps its WAL and is confirmed within %s", e.Name, ss.Slot, slotLagTooOld), found)
	}
}

// streams checks invariant 3 against the brokers: AuditStreams.
func (v *run) streams(js jetstream.JetStream, retention time.Duration) {
	audits, err := AuditStreams(v.ctx, v.shop, js, AuditConfig{Window: retention})
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

// checks runs each service's own Checks (invariant 4, mostly: however often
// events were delivered, their effects happened once).
func (v *run) checks() {
	for _, e := range v.shop.Services {
		for _, c := range e.Checks {
			if v.err != nil {
				return
			}
			var args []any
			if c.From != nil {
				args = append(args, v.rows(c.From.Service, c.From.SQL))
			}
			v.check(c.Invariant, e.Name+": "+c.Name, v.rows(e.Name, c.SQL, args...))
		}
	}
}
