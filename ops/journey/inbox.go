package journey

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

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
