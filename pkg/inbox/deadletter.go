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

// DiscardDeadLetter gives up on dead letter id for good, with a reason: the
// row stays for audit, resolved (so checks count it no longer) and marked
// discarded with the time and the reason. Nothing is applied. For a message
// that must never take effect — garbage, a forged event, the losing side of
// a conflict. It returns [ErrNotFound] if no unresolved dead letter has id.
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

// letter is a message as the dead-letter store keeps it: from JetStream or
// from the parking lot.
type letter struct {
	stream    string
	streamSeq uint64
	subject   string
	header    nats.Header
	data      []byte
	m         Message
}

// letterOf is the letter of a delivery.
func letterOf(d *delivery, meta *jetstream.MsgMetadata) letter {
	return letter{stream: meta.Stream, streamSeq: meta.Sequence.Stream, subject: d.msg.Subject(),
		header: d.msg.Headers(), data: d.msg.Data(), m: d.m}
}

// recordFailure counts a failed attempt in inbox_failures and, when the
// failure is poison or the attempts reached MaxDeliver, moves the message to
// dead_letters, all in one short transaction of its own (the handler's was
// rolled back). It reports the attempts so far and whether the message is
// now dead. extra runs in that transaction when the message dies (the
// parking lot deletes the parked row there).
func (c *Consumer) recordFailure(ctx context.Context, l letter, cause error, extra func(pgx.Tx) error) (attempts int, dead bool, err error) {
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("begin failure tx: %w", err)
	}
	defer tx.Rollback(ctx) // no-op after commit

	attempts = 1
	var first *time.Time
	if l.m.EventID != uuid.Nil { // an undecodable message may have no id; it is poison anyway
		var f time.Time
		if err := tx.QueryRow(ctx, `
			INSERT INTO inbox_failures AS f (consumer_name, event_id, attempts, first_failed_at, last_failed_at, last_error)
			VALUES ($1, $2, 1, now(), now(), $3)
			ON CONFLICT (consumer_name, event_id) DO UPDATE
			SET attempts = f.attempts + 1, last_failed_at = now(), last_error = EXCLUDED.last_error
			RETURNING attempts, first_failed_at`,
			c.cfg.Name, l.m.EventID, cause.Error()).Scan(&attempts, &f); err != nil {
			return 0, false, fmt.Errorf("record inbox failure: %w", err)
		}
		first = &f
	}
	dead = errors.Is(cause, ErrPoison) || attempts >= c.cfg.MaxDeliver
	if dead {
		if err := c.insertDeadLetter(ctx, tx, l, cause, attempts, first, nil); err != nil {
			return 0, false, err
		}
		if extra != nil {
			if err := extra(tx); err != nil {
				return 0, false, err
			}
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("commit inbox failure: %w", err)
	}
	return attempts, dead, nil
}

// insertDeadLetter writes l to dead_letters in tx and clears its failure
// count: the dead letter carries the count now; a requeue starts afresh.
// Unique per stream sequence: a copy redelivered after a lost Term updates
// this row instead of adding a second one. conflictWith, when set, is the
// event applied at l's sequence.
func (c *Consumer) insertDeadLetter(ctx context.Context, tx pgx.Tx, l letter, cause error, attempts int, first *time.Time, conflictWith *uuid.UUID) error {
	headers, err := json.Marshal(cmpHeader(l.header))
	if err != nil {
		return fmt.Errorf("encode dead letter headers: %w", err)
	}
	if _, err := tx.Exec(ctx, `
		INSERT INTO dead_letters AS dl (consumer_name, stream, stream_seq, subject, headers, payload,
			event_id, error, attempts, first_failed_at, last_failed_at, conflict_with)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, coalesce($10::timestamptz, now()), now(), $11)
		ON CONFLICT (consumer_name, stream, stream_seq) DO UPDATE
		SET error = EXCLUDED.error, attempts = dl.attempts + EXCLUDED.attempts,
		    last_failed_at = EXCLUDED.last_failed_at, requeued_at = NULL, conflict_with = EXCLUDED.conflict_with`,
		c.cfg.Name, l.stream, int64(l.streamSeq), l.subject, string(headers),
		append([]byte{}, l.data...), uuid.NullUUID{UUID: l.m.EventID, Valid: l.m.EventID != uuid.Nil},
		cause.Error(), attempts, first, conflictWith); err != nil {
		return fmt.Errorf("insert dead letter: %w", err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM inbox_failures WHERE consumer_name = $1 AND event_id = $2`,
		c.cfg.Name, l.m.EventID); err != nil {
		return fmt.Errorf("clear inbox failures: %w", err)
	}
	return nil
}

// conflicted dead-letters a delivery whose sequence was applied under
// another event id, and says so loudly: one of the two events is not what
// its producer wrote (a forged message, a producer bug), and only an
// operator can tell which. It is never counted as a duplicate.
func (c *Consumer) conflicted(ctx context.Context, d *delivery, meta *jetstream.MsgMetadata, appliedAs uuid.UUID) {
	cause := fmt.Errorf("%w: sequence %d of %s %q was applied as event %s; this is event %s",
		ErrConflict, d.m.Seq, cmpOr(d.m.AggregateType, "aggregate"), d.m.AggregateID, appliedAs, d.m.EventID)
	if err := c.deadLetterConflict(ctx, letterOf(d, meta), cause, appliedAs, nil); err != nil {
		delay := c.backoff(int(min(meta.NumDelivered, 64)))
		c.stats.retries.Add(1)
		c.log.Error("inbox conflict not recorded; will retry", "event_id", d.m.EventID, "err", err, "delay", delay)
		_ = d.msg.NakWithDelay(delay)
		return
	}
	_ = d.msg.Term()
}

// deadLetterConflict records a conflict as a dead letter, in a transaction
// of its own that also runs extra, and counts and logs it.
func (c *Consumer) deadLetterConflict(ctx context.Context, l letter, cause error, appliedAs uuid.UUID, extra func(pgx.Tx) error) error {
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin conflict tx: %w", err)
	}
	defer tx.Rollback(ctx)
	if err := c.insertDeadLetter(ctx, tx, l, cause, 1, nil, &appliedAs); err != nil {
		return err
	}
	if extra != nil {
		if err := extra(tx); err != nil {
			return err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit conflict: %w", err)
	}
	c.stats.conflicts.Add(1)
	c.stats.deadLetters.Add(1)
	c.log.Error("inbox conflict: another event was applied at this sequence; dead-lettered",
		"event_id", l.m.EventID, "applied_event_id", appliedAs, "aggregate_id", l.m.AggregateID, "seq", l.m.Seq, "subject", l.subject)
	return nil
}

func cmpOr(s, alt string) string {
	if s == "" {
		return alt
	}
	return s
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
		v   verdict
		out outcome
	)
	if err = json.Unmarshal(headers, &h); err != nil {
		err = Poison(fmt.Errorf("decode dead letter headers: %w", err))
	} else if m, err = decode(subject, h, payload); err == nil {
		actx, span := c.startSpan(ctx, m, pathRequeued, 1)
		v, err = c.apply(actx, inner, m, true)
		out = v.out
		endSpan(span, out, err)
		if errors.Is(err, errIDReused) {
			// Processed at another sequence: a duplicate by its id. The
			// savepoint is aborted; only it is rolled back.
			out, err = duplicate, nil
		} else if err == nil && out == conflict {
			err = Poison(fmt.Errorf("%w: sequence %d was applied as event %s", ErrConflict, m.Seq, v.appliedAs))
		}
	}
	if err == nil && out == gap {
		log.Debug("requeued dead letter waits for an earlier event of its aggregate", "event_id", m.EventID)
		return id, nil // roll back; it stays requeued for the next round
	}
	if err != nil && !counts(err) {
		// The database failed around the handler: it stays requeued.
		return 0, fmt.Errorf("dead letter %d: %w", id, err)
	}
	if err != nil || out != applied {
		// Nothing of a failure or a duplicate is kept but the record below.
		if rerr := inner.Rollback(ctx); rerr != nil {
			return 0, fmt.Errorf("roll back dead letter %d: %w", id, rerr)
		}
	}
	if err != nil {
		// Dead again: retrying on every round would spin on a bug; an
		// operator requeues it once more after a fix.
		if _, uerr := tx.Exec(ctx, `
			UPDATE dead_letters SET error = $2, attempts = attempts + 1, last_failed_at = now(), requeued_at = NULL
			WHERE id = $1`, id, err.Error()); uerr != nil {
			return 0, fmt.Errorf("record dead letter %d failure: %w", id, uerr)
		}
		log.Error("requeued dead letter failed again", "event_id", m.EventID, "err", err)
	}
	if err == nil && out == applied {
		if err := inner.Commit(ctx); err != nil {
			return 0, fmt.Errorf("release savepoint for dead letter %d: %w", id, err)
		}
	}
	if err == nil {
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
	// A requeue that fails again adds no dead letter: it was one already.
	switch {
	case err != nil:
	case out == applied:
		c.stats.processed.Add(1)
	default:
		c.stats.duplicates.Add(1)
	}
	return id, nil
}
