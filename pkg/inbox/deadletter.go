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
	"github.com/nats-io/nats.go/jetstream"
)

// DB is what the functions below need; a *pgxpool.Pool, a *pgx.Conn and a
// pgx.Tx all satisfy it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DeadLetter is a message a consumer gave up on, kept whole (subject,
// headers, payload) so that it can be examined and retried with its
// original event id.
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
}

// ListDeadLetters returns up to limit (default 100) unresolved dead letters
// of consumer ("" for every consumer), oldest first.
func ListDeadLetters(ctx context.Context, db DB, consumer string, limit int) ([]DeadLetter, error) {
	if limit <= 0 {
		limit = 100
	}
	rows, err := db.Query(ctx, `
		SELECT id, consumer_name, stream, stream_seq, subject, headers, payload, event_id,
		       error, attempts, first_failed_at, last_failed_at, requeued_at
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
			&dl.Error, &dl.Attempts, &dl.FirstFailedAt, &dl.LastFailedAt, &dl.RequeuedAt); err != nil {
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

// RequeueDeadLetter asks for another try of dead letter id. A running
// Consumer of that name picks it up within a second and processes it
// exactly as if it had just arrived: the same event id, the same inbox
// steps, the same handler. Success resolves the dead letter in the
// handler's transaction; a failure makes it dead again (requeue once more
// after a fix); while an earlier event of its aggregate is missing it stays
// requeued. It returns [ErrNotFound] if no unresolved dead letter has id.
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

// Cleanup deletes the processed_events rows of consumer older than
// olderThan, batch rows (default 1000) per statement so that no statement
// holds many locks or runs long, and returns how many it deleted. olderThan
// must respect the windows rule (see the package documentation); a running
// Consumer calls Cleanup with its Retention every hour. inbox_sequences rows
// are kept: they also catch replays older than the retention.
func Cleanup(ctx context.Context, db DB, consumer string, olderThan time.Duration, batch int) (deleted int64, err error) {
	if batch <= 0 {
		batch = 1000
	}
	for {
		// SKIP LOCKED: instances cleaning up at the same time take different rows.
		tag, err := db.Exec(ctx, `
			DELETE FROM processed_events p
			USING (
				SELECT event_id FROM processed_events
				WHERE consumer_name = $1 AND processed_at < now() - $2 * interval '1 microsecond'
				LIMIT $3
				FOR UPDATE SKIP LOCKED
			) old
			WHERE p.consumer_name = $1 AND p.event_id = old.event_id`,
			consumer, olderThan.Microseconds(), batch)
		if err != nil {
			return deleted, fmt.Errorf("delete processed events of %s: %w", consumer, err)
		}
		deleted += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return deleted, nil
		}
	}
}

// recordFailure counts a failed attempt in inbox_failures and, when the
// failure is poison or the attempts reached MaxDeliver, moves the message to
// dead_letters, all in one short transaction of its own (the handler's was
// rolled back). It reports the attempts so far and whether the message is
// now dead.
func (c *Consumer) recordFailure(ctx context.Context, d *delivery, meta *jetstream.MsgMetadata, cause error) (attempts int, dead bool, err error) {
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("begin failure tx: %w", err)
	}
	defer tx.Rollback(ctx) // no-op after commit

	attempts = 1
	var first *time.Time
	if d.m.EventID != uuid.Nil { // an undecodable message may have no id; it is poison anyway
		var f time.Time
		if err := tx.QueryRow(ctx, `
			INSERT INTO inbox_failures AS f (consumer_name, event_id, attempts, first_failed_at, last_failed_at, last_error)
			VALUES ($1, $2, 1, now(), now(), $3)
			ON CONFLICT (consumer_name, event_id) DO UPDATE
			SET attempts = f.attempts + 1, last_failed_at = now(), last_error = EXCLUDED.last_error
			RETURNING attempts, first_failed_at`,
			c.cfg.Name, d.m.EventID, cause.Error()).Scan(&attempts, &f); err != nil {
			return 0, false, fmt.Errorf("record inbox failure: %w", err)
		}
		first = &f
	}
	dead = errors.Is(cause, ErrPoison) || attempts >= c.cfg.MaxDeliver
	if dead {
		headers, err := json.Marshal(cmpHeader(d.msg.Headers()))
		if err != nil {
			return 0, false, fmt.Errorf("encode dead letter headers: %w", err)
		}
		// Unique per stream sequence: a copy redelivered after a lost Term
		// updates this row instead of adding a second one.
		if _, err := tx.Exec(ctx, `
			INSERT INTO dead_letters AS dl (consumer_name, stream, stream_seq, subject, headers, payload,
				event_id, error, attempts, first_failed_at, last_failed_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, coalesce($10::timestamptz, now()), now())
			ON CONFLICT (consumer_name, stream, stream_seq) DO UPDATE
			SET error = EXCLUDED.error, attempts = dl.attempts + EXCLUDED.attempts,
			    last_failed_at = EXCLUDED.last_failed_at, requeued_at = NULL`,
			c.cfg.Name, meta.Stream, int64(meta.Sequence.Stream), d.msg.Subject(), string(headers),
			append([]byte{}, d.msg.Data()...), uuid.NullUUID{UUID: d.m.EventID, Valid: d.m.EventID != uuid.Nil},
			cause.Error(), attempts, first); err != nil {
			return 0, false, fmt.Errorf("insert dead letter: %w", err)
		}
		// The dead letter carries the count now; a requeue starts afresh.
		if _, err := tx.Exec(ctx, `DELETE FROM inbox_failures WHERE consumer_name = $1 AND event_id = $2`,
			c.cfg.Name, d.m.EventID); err != nil {
			return 0, false, fmt.Errorf("clear inbox failures: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("commit inbox failure: %w", err)
	}
	return attempts, dead, nil
}

// cmpHeader stores a missing header set as {} rather than null.
func cmpHeader(h nats.Header) nats.Header {
	if h == nil {
		return nats.Header{}
	}
	return h
}

// replayRequeued processes the requeued dead letters of this consumer, one
// transaction each, until none is left or ctx ends.
func (c *Consumer) replayRequeued(ctx, work context.Context) {
	var after int64
	for ctx.Err() == nil {
		id, err := c.replayOne(work, after)
		if err != nil {
			c.log.Error("inbox dead letter replay failed; will retry", "err", err)
			return
		}
		if id == 0 {
			return
		}
		after = id
	}
}

// replayOne takes the first requeued dead letter after id after and runs it
// through apply, as if it had just arrived from JetStream. The row is locked
// (SKIP LOCKED: instances take different ones) for the whole transaction,
// and the handler works in a savepoint, so that resolving the dead letter
// commits with the effect, or recording the new failure commits without it.
// It returns the id it handled, 0 when none is left.
func (c *Consumer) replayOne(ctx context.Context, after int64) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
	defer cancel()
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin dead letter tx: %w", err)
	}
	defer tx.Rollback(ctx) // no-op after commit

	var (
		id               int64
		subject          string
		headers, payload []byte
		h                nats.Header
	)
	err = tx.QueryRow(ctx, `
		SELECT id, subject, headers, payload FROM dead_letters
		WHERE consumer_name = $1 AND requeued_at IS NOT NULL AND resolved_at IS NULL AND id > $2
		ORDER BY id LIMIT 1
		FOR UPDATE SKIP LOCKED`, c.cfg.Name, after).Scan(&id, &subject, &headers, &payload)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("claim requeued dead letter: %w", err)
	}
	log := c.log.With("dead_letter", id, "subject", subject)

	inner, err := tx.Begin(ctx) // a savepoint
	if err != nil {
		return 0, fmt.Errorf("savepoint for dead letter %d: %w", id, err)
	}
	var (
		m   Message
		out outcome
	)
	if err = json.Unmarshal(headers, &h); err != nil {
		err = Poison(fmt.Errorf("decode dead letter headers: %w", err))
	} else if m, err = decode(subject, h, payload); err == nil {
		out, err = c.apply(ctx, inner, m, true)
	}
	if err == nil && out == gap {
		log.Debug("requeued dead letter waits for an earlier event of its aggregate", "event_id", m.EventID)
		return id, nil // roll back; it stays requeued for the next round
	}
	if err != nil && !counts(err) {
		// The database failed around the handler: it stays requeued.
		return 0, fmt.Errorf("dead letter %d: %w", id, err)
	}
	if err != nil {
		if rerr := inner.Rollback(ctx); rerr != nil {
			return 0, fmt.Errorf("roll back dead letter %d: %w", id, rerr)
		}
		// Dead again: retrying on every round would spin on a bug; an
		// operator requeues it once more after a fix.
		if _, uerr := tx.Exec(ctx, `
			UPDATE dead_letters SET error = $2, attempts = attempts + 1, last_failed_at = now(), requeued_at = NULL
			WHERE id = $1`, id, err.Error()); uerr != nil {
			return 0, fmt.Errorf("record dead letter %d failure: %w", id, uerr)
		}
		log.Error("requeued dead letter failed again", "event_id", m.EventID, "err", err)
	} else {
		if err := inner.Commit(ctx); err != nil {
			return 0, fmt.Errorf("release savepoint for dead letter %d: %w", id, err)
		}
		// Resolved in the same transaction as the effect: never applied
		// without being resolved, nor resolved without being applied.
		if _, err := tx.Exec(ctx, `UPDATE dead_letters SET resolved_at = now() WHERE id = $1`, id); err != nil {
			return 0, fmt.Errorf("resolve dead letter %d: %w", id, err)
		}
		log.Info("requeued dead letter processed", "event_id", m.EventID, "duplicate", out != applied)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit dead letter %d: %w", id, err)
	}
	switch {
	case err != nil:
		c.stats.deadLetters.Add(1)
	case out == applied:
		c.stats.processed.Add(1)
	default:
		c.stats.duplicates.Add(1)
	}
	return id, nil
}
