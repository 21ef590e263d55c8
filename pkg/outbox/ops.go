package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

type pgconnTag = pgconn.CommandTag

// Stats describe the backlog of one outbox.
type Stats struct {
	Pending       int64         // committed, not yet published, not dead
	Dead          int64         // given up on; waiting for an operator
	OldestPending time.Duration // age of the oldest pending event; 0 when none
}

// ReadStats reads the backlog. It touches only the small partial indexes of
// pending and dead rows, so it is cheap enough for every metrics scrape.
func ReadStats(ctx context.Context, db DB) (Stats, error) {
	var s Stats
	var oldest *time.Duration
	err := db.QueryRow(ctx, `
		SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL),
		       (SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL),
		       (SELECT now() - occurred_at FROM outbox WHERE published_at IS NULL AND dead_at IS NULL
		        ORDER BY event_id LIMIT 1)`).Scan(&s.Pending, &s.Dead, &oldest)
	if err != nil {
		return Stats{}, fmt.Errorf("read outbox stats: %w", err)
	}
	if oldest != nil {
		s.OldestPending = max(*oldest, 0)
	}
	return s, nil
}

// Record is an outbox row as an operator sees it.
type Record struct {
	EventID       uuid.UUID
	AggregateType string
	AggregateID   string
	Seq           int64
	Type          string
	SchemaVersion int
	Subject       string
	Payload       []byte
	Headers       map[string]string
	OccurredAt    time.Time
	Attempts      int
	LastError     *string
	ClaimedBy     *string
	PublishedAt   *time.Time
	DeadAt        *time.Time
}

const recordColumns = `event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version,
	subject, payload, headers, occurred_at, attempts, last_error, claimed_by, published_at, dead_at`

func scanRecord(row pgx.CollectableRow) (Record, error) {
	var r Record
	err := row.Scan(&r.EventID, &r.AggregateType, &r.AggregateID, &r.Seq, &r.Type, &r.SchemaVersion,
		&r.Subject, &r.Payload, &r.Headers, &r.OccurredAt, &r.Attempts, &r.LastError, &r.ClaimedBy,
		&r.PublishedAt, &r.DeadAt)
	return r, err
}

// Get returns one event.
func Get(ctx context.Context, db DB, eventID uuid.UUID) (Record, error) {
	rows, err := db.Query(ctx, `SELECT `+recordColumns+` FROM outbox WHERE event_id = $1`, eventID)
	if err != nil {
		return Record{}, fmt.Errorf("get outbox event %s: %w", eventID, err)
	}
	r, err := pgx.CollectExactlyOneRow(rows, scanRecord)
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, fmt.Errorf("%w: %s", ErrNotFound, eventID)
	}
	if err != nil {
		return Record{}, fmt.Errorf("get outbox event %s: %w", eventID, err)
	}
	return r, nil
}

// ListDead returns up to limit dead events, oldest first.
func ListDead(ctx context.Context, db DB, limit int) ([]Record, error) {
	rows, err := db.Query(ctx, `SELECT `+recordColumns+` FROM outbox WHERE dead_at IS NOT NULL
		ORDER BY dead_at LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("list dead outbox events: %w", err)
	}
	recs, err := pgx.CollectRows(rows, scanRecord)
	if err != nil {
		return nil, fmt.Errorf("list dead outbox events: %w", err)
	}
	return recs, nil
}

// Requeue gives a dead or waiting event a fresh start: attempts reset, due
// now. Its id is kept, so consumers that already saw it ignore the copy. An
// event that was already published is left alone (use Republish).
func Requeue(ctx context.Context, db DB, eventID uuid.UUID) error {
	tag, err := db.Exec(ctx, `
		UPDATE outbox SET dead_at = NULL, attempts = 0, available_at = now(), last_error = NULL,
		       claimed_by = NULL, claim_token = NULL, claim_until = NULL
		WHERE event_id = $1 AND published_at IS NULL`, eventID)
	if err != nil {
		return fmt.Errorf("requeue outbox event %s: %w", eventID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w (or already published): %s", ErrNotFound, eventID)
	}
	return nil
}

// Republish publishes an already published event once more, with the same
// id; consumers that processed it treat the copy as a duplicate.
func Republish(ctx context.Context, db DB, eventID uuid.UUID) error {
	tag, err := db.Exec(ctx, `
		UPDATE outbox SET published_at = NULL, available_at = now(), attempts = 0
		WHERE event_id = $1 AND published_at IS NOT NULL`, eventID)
	if err != nil {
		return fmt.Errorf("republish outbox event %s: %w", eventID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w (or not yet published): %s", ErrNotFound, eventID)
	}
	return nil
}

// RepublishAll is Republish of many events in one statement, so a relay
// sees all the copies or none, and sends each aggregate's in sequence
// order: the repair for events the broker acknowledged and then lost. Ids
// that are not published events of this outbox are skipped; it returns the
// ids it marked. JetStream drops a copy whose id it still remembers (its
// duplicate window), so a message deleted by hand comes back only after it.
func RepublishAll(ctx context.Context, db DB, eventIDs []uuid.UUID) ([]uuid.UUID, error) {
	rows, err := db.Query(ctx, `
		UPDATE outbox SET published_at = NULL, available_at = now(), attempts = 0
		WHERE event_id = ANY($1) AND published_at IS NOT NULL
		RETURNING event_id`, eventIDs)
	if err != nil {
		return nil, fmt.Errorf("republish %d outbox events: %w", len(eventIDs), err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		return nil, fmt.Errorf("republish %d outbox events: %w", len(eventIDs), err)
	}
	return ids, nil
}

// deleteExpired deletes up to batch-sized chunks of events published more
// than olderThan ago and returns how many went; failpoint is the relay's
// hook (nil: none). Pending and dead events are never deleted; sequence
// counters stay, so numbering continues gap-free.
func deleteExpired(ctx context.Context, db DB, olderThan time.Duration, batch int, failpoint func(string) error) (int64, error) {
	var total int64
	for {
		if total > 0 && failpoint != nil {
			// Failure window: some batches are deleted (each its own
			// statement, committed), the rest are not. The next run
			// deletes them; pending and dead rows are never candidates.
			if err := failpoint(failpointRetentionMidBatch); err != nil {
				return total, err
			}
		}
		tag, err := db.Exec(ctx, `
			DELETE FROM outbox WHERE event_id IN (
				SELECT event_id FROM outbox
				WHERE published_at < now() - $1 * interval '1 microsecond'
				ORDER BY published_at LIMIT $2
				FOR UPDATE SKIP LOCKED)`, olderThan.Microseconds(), batch)
		if err != nil {
			return total, fmt.Errorf("delete published outbox events: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}
