package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
)

// DB is what the functions below need; a *pgxpool.Pool, a *pgx.Conn and a
// pgx.Tx all satisfy it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DeadLetter is a message a consumer gave up on, kept whole to be examined
// and requeued.
type DeadLetter struct {
	ID            int64
	Consumer      string
	Stream        string
	StreamSeq     uint64
	Subject       string
	Header        nats.Header
	Data          []byte
	EventID       uuid.UUID // uuid.Nil when the message had no readable event id
	Error         string    // the last failure
	Attempts      int
	FirstFailedAt time.Time
	LastFailedAt  time.Time
	RequeuedAt    *time.Time // set while a requeue waits to be retried
	ConflictWith  *uuid.UUID // a conflict: the event applied at this event's sequence (see ErrConflict)
}

// ListDeadLetters returns up to limit (default 100) unresolved dead letters
// of consumer ("" for every consumer), oldest first.
func ListDeadLetters(ctx context.Context, db DB, consumer string, limit int) ([]DeadLetter, error) {
	if limit <= 0 {
		limit = 100
	}
	rows, err := db.Query(ctx, `
		SELECT id, consumer_name, stream, stream_seq, subject, headers, payload, event_id,
		       error, attempts, first_failed_at, last_failed_at, requeued_at, conflict_with
		FROM dead_letters
		WHERE resolved_at IS NULL AND ($1 = '' OR consumer_name = $1)
		ORDER BY id
		LIMIT $2`, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		var (
			dl      DeadLetter
			seq     int64
			headers []byte
			eventID uuid.NullUUID
		)
		if err := rows.Scan(&dl.ID, &dl.Consumer, &dl.Stream, &seq, &dl.Subject, &headers, &dl.Data, &eventID,
			&dl.Error, &dl.Attempts, &dl.FirstFailedAt, &dl.LastFailedAt, &dl.RequeuedAt, &dl.ConflictWith); err != nil {
			return nil, fmt.Errorf("scan dead letter: %w", err)
		}
		if err := json.Unmarshal(headers, &dl.Header); err != nil {
			return nil, fmt.Errorf("dead letter %d headers: %w", dl.ID, err)
		}
		dl.StreamSeq, dl.EventID = uint64(seq), eventID.UUID
		out = append(out, dl)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return out, nil
}

// RequeueDeadLetter has a running Consumer of its name apply dead letter id
// again, with its event id, within a second; a failure makes it dead again.
func RequeueDeadLetter(ctx context.Context, db DB, id int64) error {
	tag, err := db.Exec(ctx,
		`UPDATE dead_letters SET requeued_at = now() WHERE id = $1 AND resolved_at IS NULL`, id)
	if err != nil {
		return fmt.Errorf("requeue dead letter %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("requeue dead letter %d: %w", id, ErrNotFound)
	}
	return nil
}

// DiscardDeadLetter gives up on dead letter id for good, applying nothing;
// the row stays for audit, resolved, with the time and the reason.
func DiscardDeadLetter(ctx context.Context, db DB, id int64, reason string) error {
	if reason == "" {
		return errors.New("inbox: a discard needs a reason")
	}
	tag, err := db.Exec(ctx, `UPDATE dead_letters SET resolved_at = now(), discarded_at = now(), discard_reason = $2,
		requeued_at = NULL WHERE id = $1 AND resolved_at IS NULL`, id, reason)
	if err != nil {
		return fmt.Errorf("discard dead letter %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("discard dead letter %d: %w", id, ErrNotFound)
	}
	return nil
}
