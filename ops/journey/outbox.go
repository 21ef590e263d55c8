package journey

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

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
