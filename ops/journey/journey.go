package journey

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
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
