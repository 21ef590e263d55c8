package journey

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// DB is what Load reads a schema through; a *pgxpool.Pool satisfies it.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ErrNotFound means no schema knows the order: no order row, no history,
// no event.
var ErrNotFound = errors.New("journey: no such order")

// Kind says what an Entry records.
type Kind string

// The kinds of entries, as the JSON "kind" carries them.
const (
	Committed  Kind = "committed"   // an event's outbox row committed with its business change
	Published  Kind = "published"   // the relay had the broker's ack and marked the row
	Dead       Kind = "dead"        // the relay gave up on the event (outbox dead_at)
	Processed  Kind = "processed"   // a consumer applied the event (processed_events)
	Failing    Kind = "failing"     // a consumer's attempts failed so far (inbox_failures)
	DeadLetter Kind = "dead_letter" // a consumer gave up on a message (dead_letters)
	Parked     Kind = "parked"      // a consumer holds the event until an earlier one comes
	State      Kind = "state"       // the order entered a state (order_history)
	Unexpected Kind = "unexpected"  // the saga had no transition for an event and ignored it
)

// Journey is one order's journey.
type Journey struct {
	OrderID string `json:"order_id"`
	// Status is the order's state now; "" when the order service has no
	// such order (its events may still be found).
	Status string `json:"status"`
	// Entries is the timeline, oldest first.
	Entries []Entry `json:"entries"`
	// Timeouts are the saga's durable timeouts still armed for the order.
	Timeouts []Timeout `json:"timeouts"`
	// Notes say what the tables no longer hold.
	Notes []string `json:"notes"`
}

// Entry is one step of a journey.
type Entry struct {
	At        time.Time `json:"at"`
	Kind      Kind      `json:"kind"`
	Service   string    `json:"service"`              // whose tables recorded it: the producer, or the consumer's service
	EventType string    `json:"event_type,omitempty"` // every kind but State
	EventID   string    `json:"event_id,omitempty"`
	Seq       int64     `json:"seq,omitempty"`      // the event's Aggregate-Seq, when known
	Consumer  string    `json:"consumer,omitempty"` // Processed, Failing, DeadLetter, Parked
	State     string    `json:"state,omitempty"`    // State, and the saga's state for Unexpected
	What      string    `json:"what"`               // the entry in words, as the page and `shop trace` print it
	// SincePrevious is the time since the entry before it (0 for the
	// first): JSON since_previous_seconds.
	SincePrevious time.Duration `json:"-"`
	// Hop is the time this step of its event took, measured from the step
	// HopFrom names: a publish from the commit, a consumer's processing
	// (or failure, dead letter, parking) from the publish, or from the
	// commit when the consumer committed before the relay recorded the
	// publish. Zero, with HopFrom "", for the order's own steps (states,
	// commits). JSON hop_seconds.
	Hop     time.Duration `json:"-"`
	HopFrom Kind          `json:"hop_from,omitempty"`
}

// MarshalJSON writes the durations in seconds, as the dashboard's other
// durations are.
func (e Entry) MarshalJSON() ([]byte, error) {
	type plain Entry
	var hop *float64
	if e.HopFrom != "" {
		s := e.Hop.Seconds()
		hop = &s
	}
	return json.Marshal(struct {
		plain
		SincePrevious float64  `json:"since_previous_seconds"`
		Hop           *float64 `json:"hop_seconds,omitempty"`
	}{plain(e), e.SincePrevious.Seconds(), hop})
}

// Timeout is a durable timeout of the order's saga, not yet fired.
type Timeout struct {
	Name  string    `json:"name"`
	DueAt time.Time `json:"due_at"`
}

// services is the order Load reads the pools in; others follow by name.
var services = []string{"order", "inventory", "payment", "fulfillment"}

// event is an outbox row of the order, and what the other steps need of it.
type event struct {
	service     string
	id          uuid.UUID
	typ         string
	seq         int64
	occurred    time.Time
	published   *time.Time
	dead        *time.Time
	attempts    int
	lastError   *string
	availableAt time.Time
}

// Load reads the journey of order id from pools, one per service by name
// ("order", "inventory", …), each bound to that service's schema; "order"
// is required. It only reads, a few indexed queries per schema.
func Load(ctx context.Context, pools map[string]DB, id uuid.UUID) (Journey, error) {
	orders := pools["order"]
	if orders == nil {
		return Journey{}, errors.New("journey: pools must hold the order service's pool")
	}
	j := Journey{OrderID: id.String(), Entries: []Entry{}, Timeouts: []Timeout{}, Notes: []string{}}
	if err := loadSaga(ctx, orders, id, &j); err != nil {
		return Journey{}, err
	}

	names := names(pools)
	events := map[uuid.UUID]*event{}
	var ids []uuid.UUID
	for _, name := range names {
		evs, err := loadEvents(ctx, pools[name], name, id)
		if err != nil {
			return Journey{}, fmt.Errorf("journey: %s: %w", name, err)
		}
		for _, e := range evs {
			events[e.id] = e
			ids = append(ids, e.id)
			j.Entries = append(j.Entries, eventEntries(e)...)
		}
		if len(evs) > 0 && evs[0].seq > 1 {
			j.Notes = append(j.Notes, fmt.Sprintf("%s: the order's events before seq %d are no longer in its outbox "+
				"(published events are deleted after the relay's retention)", name, evs[0].seq))
		}
	}
	if len(ids) == 0 && len(j.Entries) > 0 {
		j.Notes = append(j.Notes, "none of the order's events is still in an outbox "+
			"(published events are deleted after the relay's retention): only its state changes remain")
	}
	for _, name := range names {
		es, err := loadInbox(ctx, pools[name], name, id, ids, events)
		if err != nil {
			return Journey{}, fmt.Errorf("journey: %s: %w", name, err)
		}
		j.Entries = append(j.Entries, es...)
	}
	if j.Status == "" && len(j.Entries) == 0 {
		return Journey{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}

	// Steps of one transaction can share an instant: the cause first.
	slices.SortStableFunc(j.Entries, func(a, b Entry) int {
		return cmp.Or(a.At.Compare(b.At), cmp.Compare(rank[a.Kind], rank[b.Kind]))
	})
	for i := 1; i < len(j.Entries); i++ {
		j.Entries[i].SincePrevious = j.Entries[i].At.Sub(j.Entries[i-1].At)
	}
	return j, nil
}

// rank orders the entries of one instant: an event consumed, then the state
// change it caused, then the events that change committed, then their
// publishing.
var rank = map[Kind]int{Processed: 0, Failing: 0, DeadLetter: 0, Parked: 0, State: 1, Unexpected: 1, Committed: 2, Published: 3, Dead: 3}

// names returns the services of pools: the known ones in order, then any
// others by name.
func names(pools map[string]DB) []string {
	var out, rest []string
	for _, n := range services {
		if pools[n] != nil {
			out = append(out, n)
		}
	}
	for n := range pools {
		if !slices.Contains(services, n) {
			rest = append(rest, n)
		}
	}
	slices.Sort(rest)
	return append(out, rest...)
}

// loadSaga reads the order's status, its history, the events its saga
// ignored and its armed timeouts from the order schema.
func loadSaga(ctx context.Context, db DB, id uuid.UUID, j *Journey) error {
	err := db.QueryRow(ctx, `SELECT status FROM orders WHERE order_id = $1`, id).Scan(&j.Status)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("journey: read order %s: %w", id, err)
	}
	rows, err := db.Query(ctx, `SELECT status, at, coalesce(reason, '') FROM order_history
		WHERE order_id = $1 ORDER BY id`, id)
	if err != nil {
		return fmt.Errorf("journey: read history of %s: %w", id, err)
	}
	var (
		status, reason, prev string
		at                   time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&status, &at, &reason}, func() error {
		what := "state " + status
		switch {
		case prev == status:
			what = "state " + status + " stays"
		case prev != "":
			what = "state " + prev + " → " + status
		}
		if reason != "" {
			what += " (" + reason + ")"
		}
		j.Entries = append(j.Entries, Entry{At: at, Kind: State, Service: "order", State: status, What: what})
		prev = status
		return nil
	})
	if err != nil {
		return fmt.Errorf("journey: read history of %s: %w", id, err)
	}

	rows, err = db.Query(ctx, `SELECT coalesce(state, ''), event_type, coalesce(event_id, ''), recorded_at
		FROM saga_unexpected WHERE saga_id = $1 ORDER BY id`, id.String())
	if err != nil {
		return fmt.Errorf("journey: read the saga's unexpected events of %s: %w", id, err)
	}
	var typ, eventID string
	_, err = pgx.ForEachRow(rows, []any{&status, &typ, &eventID, &at}, func() error {
		what := "saga ignored " + typ + " in state " + status + " (no transition)"
		if status == "" {
			what = "saga ignored " + typ + ": no saga instance"
		}
		j.Entries = append(j.Entries, Entry{At: at, Kind: Unexpected, Service: "order", EventType: typ,
			EventID: eventID, State: status, What: what})
		return nil
	})
	if err != nil {
		return fmt.Errorf("journey: read the saga's unexpected events of %s: %w", id, err)
	}

	rows, err = db.Query(ctx, `SELECT name, due_at FROM saga_timeouts WHERE saga_id = $1 ORDER BY due_at, name`, id.String())
	if err != nil {
		return fmt.Errorf("journey: read the saga's timeouts of %s: %w", id, err)
	}
	j.Timeouts, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Timeout])
	if err != nil {
		return fmt.Errorf("journey: read the saga's timeouts of %s: %w", id, err)
	}
	return nil
}

// loadEvents reads the order's events from one outbox, in sequence order.
// Every event about an order has the aggregate ("order", id) whichever
// service emits it (the contract's subjects), so the outbox's unique index
// on the aggregate finds them.
func loadEvents(ctx context.Context, db DB, service string, id uuid.UUID) ([]*event, error) {
	rows, err := db.Query(ctx, `SELECT event_id, event_type, aggregate_seq, occurred_at, published_at, dead_at,
			attempts, last_error, available_at
		FROM outbox WHERE aggregate_type = 'order' AND aggregate_id = $1 ORDER BY aggregate_seq`, id.String())
	if err != nil {
		return nil, fmt.Errorf("read outbox: %w", err)
	}
	evs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (*event, error) {
		e := &event{service: service}
		err := row.Scan(&e.id, &e.typ, &e.seq, &e.occurred, &e.published, &e.dead, &e.attempts, &e.lastError, &e.availableAt)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("read outbox: %w", err)
	}
	return evs, nil
}

// eventEntries are the producer's steps of e: committed, then published or
// dead.
func eventEntries(e *event) []Entry {
	base := Entry{Service: e.service, EventType: e.typ, EventID: e.id.String(), Seq: e.seq}
	failed := ""
	if e.attempts > 0 {
		failed = fmt.Sprintf(" after %d failed attempt%s", e.attempts, plural(e.attempts))
		if e.lastError != nil {
			failed += " (last: " + oneLine(*e.lastError) + ")"
		}
	}
	committed := base
	committed.At, committed.Kind = e.occurred, Committed
	committed.What = fmt.Sprintf("%s committed (seq %d)", e.typ, e.seq)
	if e.published == nil && e.dead == nil {
		committed.What += ", not published yet" + failed
		if e.attempts > 0 {
			committed.What += ", next try at " + e.availableAt.UTC().Format("15:04:05.000")
		}
	}
	out := []Entry{committed}
	switch {
	case e.published != nil:
		p := base
		p.At, p.Kind, p.Hop, p.HopFrom = *e.published, Published, e.published.Sub(e.occurred), Committed
		p.What = e.typ + " published by the relay" + failed
		out = append(out, p)
	case e.dead != nil:
		d := base
		d.At, d.Kind, d.Hop, d.HopFrom = *e.dead, Dead, e.dead.Sub(e.occurred), Committed
		d.What = e.typ + " dead in the outbox" + failed + ": never published (shop outbox requeue)"
		out = append(out, d)
	}
	return out
}

// consumed fills in what a consumer's step of event id knows of it: its
// type, sequence and the hop since its publish (or commit). typeOf is the
// type when the outbox no longer holds the event.
func consumed(en Entry, e *event, typeOf string) Entry {
	en.EventType = typeOf
	if e == nil {
		return en
	}
	en.EventType, en.Seq = e.typ, e.seq
	if e.published != nil && !en.At.Before(*e.published) {
		en.Hop, en.HopFrom = en.At.Sub(*e.published), Published
	} else {
		en.Hop, en.HopFrom = en.At.Sub(e.occurred), Committed
	}
	return en
}

// processedSQL finds the processed_events rows of the given events. The
// primary key leads with consumer_name, and a schema has only a handful of
// consumers: the recursive part walks the index from one consumer name to
// the next (a loose index scan, which Postgres does not do by itself), so
// that each consumer costs an index probe per event instead of the whole
// table being read.
const processedSQL = `
WITH RECURSIVE consumer AS (
	(SELECT consumer_name FROM processed_events ORDER BY consumer_name LIMIT 1)
	UNION ALL
	SELECT (SELECT p.consumer_name FROM processed_events p WHERE p.consumer_name > c.consumer_name
	        ORDER BY p.consumer_name LIMIT 1)
	FROM consumer c WHERE c.consumer_name IS NOT NULL
)
SELECT p.consumer_name, p.event_id, p.processed_at
FROM consumer c JOIN processed_events p ON p.consumer_name = c.consumer_name AND p.event_id = ANY($1)
ORDER BY p.processed_at, p.consumer_name`

// loadInbox reads what the consumers of one service did with the order's
// events (ids; events by id): processed, failing, dead-lettered, parked.
// Dead letters and parked events are also found by the order id in their
// subject or aggregate, for a message whose outbox row is gone (or that
// could not be decoded).
func loadInbox(ctx context.Context, db DB, service string, id uuid.UUID, ids []uuid.UUID, events map[uuid.UUID]*event) ([]Entry, error) {
	var out []Entry
	if ids == nil {
		ids = []uuid.UUID{}
	}
	rows, err := db.Query(ctx, processedSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("read processed events: %w", err)
	}
	var (
		consumer string
		eventID  uuid.UUID
		at       time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&consumer, &eventID, &at}, func() error {
		e := events[eventID]
		en := consumed(Entry{At: at, Kind: Processed, Service: service, EventID: eventID.String(), Consumer: consumer}, e, "")
		en.What = en.EventType + " processed by " + consumer
		out = append(out, en)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read processed events: %w", err)
	}

	rows, err = db.Query(ctx, `SELECT consumer_name, event_id, attempts, first_failed_at, last_failed_at, last_error
		FROM inbox_failures WHERE event_id = ANY($1) ORDER BY last_failed_at`, ids)
	if err != nil {
		return nil, fmt.Errorf("read inbox failures: %w", err)
	}
	var (
		attempts     int
		first, last  time.Time
		lastError    string
		subject      string
		nullEventID  *uuid.UUID
		conflictWith *uuid.UUID
		discarded    *time.Time
		requeued     *time.Time
		resolved     *time.Time
		reason       *string
	)
	_, err = pgx.ForEachRow(rows, []any{&consumer, &eventID, &attempts, &first, &last, &lastError}, func() error {
		en := consumed(Entry{At: last, Kind: Failing, Service: service, EventID: eventID.String(), Consumer: consumer}, events[eventID], "")
		en.What = fmt.Sprintf("%s failing in %s: %d attempt%s since %s, retried with backoff (last error: %s)",
			en.EventType, consumer, attempts, plural(attempts), first.UTC().Format("15:04:05.000"), oneLine(lastError))
		out = append(out, en)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read inbox failures: %w", err)
	}

	rows, err = db.Query(ctx, `SELECT consumer_name, event_id, subject, attempts, last_failed_at, error,
			conflict_with, requeued_at, resolved_at, discarded_at, discard_reason
		FROM dead_letters WHERE event_id = ANY($1) OR (event_id IS NULL AND split_part(subject, '.', 2) = $2)
		ORDER BY id`, ids, id.String())
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	_, err = pgx.ForEachRow(rows, []any{&consumer, &nullEventID, &subject, &attempts, &last, &lastError,
		&conflictWith, &requeued, &resolved, &discarded, &reason}, func() error {
		en := Entry{At: last, Kind: DeadLetter, Service: service, Consumer: consumer}
		var e *event
		if nullEventID != nil {
			en.EventID, e = nullEventID.String(), events[*nullEventID]
		}
		en = consumed(en, e, typeOfSubject(subject))
		en.What = fmt.Sprintf("%s dead-lettered by %s after %d attempt%s: %s", en.EventType, consumer, attempts, plural(attempts), oneLine(lastError))
		if conflictWith != nil {
			en.What += " (conflict: its seq was applied as event " + conflictWith.String() + ")"
		}
		switch {
		case discarded != nil:
			en.What += "; discarded at " + discarded.UTC().Format("15:04:05.000") + ": " + oneLine(deref(reason))
		case resolved != nil:
			en.What += "; requeued and processed at " + resolved.UTC().Format("15:04:05.000")
		case requeued != nil:
			en.What += "; requeued at " + requeued.UTC().Format("15:04:05.000") + ", waiting for its retry"
		default:
			en.What += "; open (shop outbox dead-letters requeue|discard)"
		}
		out = append(out, en)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}

	rows, err = db.Query(ctx, `SELECT consumer_name, event_id, subject, aggregate_seq, parked_at, discarded_at, discard_reason
		FROM inbox_parked WHERE aggregate_id = $2 OR event_id = ANY($1) ORDER BY parked_at`, ids, id.String())
	if err != nil {
		return nil, fmt.Errorf("read parked events: %w", err)
	}
	var seq int64
	_, err = pgx.ForEachRow(rows, []any{&consumer, &eventID, &subject, &seq, &at, &discarded, &reason}, func() error {
		en := consumed(Entry{At: at, Kind: Parked, Service: service, EventID: eventID.String(), Consumer: consumer}, events[eventID], typeOfSubject(subject))
		en.Seq = seq
		en.What = fmt.Sprintf("%s (seq %d) parked by %s: an earlier event of the order has not arrived", en.EventType, seq, consumer)
		if discarded != nil {
			en.What += "; discarded at " + discarded.UTC().Format("15:04:05.000") + ": " + oneLine(deref(reason))
		}
		out = append(out, en)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read parked events: %w", err)
	}
	return out, nil
}

// typeOfSubject is the event type a subject names: its last token.
func typeOfSubject(subject string) string {
	return subject[strings.LastIndexByte(subject, '.')+1:]
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// oneLine keeps an error message to one line of reasonable length.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > 200 {
		s = string(r[:199]) + "…"
	}
	return s
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
