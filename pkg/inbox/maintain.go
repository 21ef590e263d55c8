package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
)

// maintain replays requeued dead letters and deletes old inbox rows until
// ctx ends; work outlives ctx so that a started replay transaction finishes.
func (c *Consumer) maintain(ctx, work context.Context) {
	requeue := time.NewTicker(c.requeueEvery)
	defer requeue.Stop()
	cleanup := time.NewTicker(c.cleanupEvery)
	defer cleanup.Stop()
	c.cleanup(ctx) // at start too: a process that restarts often would never reach the first tick
	for {
		select {
		case <-ctx.Done():
			return
		case <-requeue.C:
			c.replayRequeued(ctx, work)
			if !c.cfg.SkipSequenceCheck {
				c.sweepParked(work)
			}
		case <-cleanup.C:
			c.cleanup(ctx)
		}
	}
}

// cleanup may be cut off by shutdown: each batch is its own statement.
func (c *Consumer) cleanup(ctx context.Context) {
	n, err := deleteProcessed(ctx, c.pool, c.cfg.Name, c.cfg.Retention, 1000)
	if err != nil {
		if ctx.Err() == nil {
			c.log.Error("inbox cleanup failed", "err", err)
		}
		return
	}
	if n > 0 {
		c.log.Info("inbox cleanup deleted old processed events", "deleted", n)
	}
}

// deleteProcessed deletes the processed_events rows of consumer older than
// olderThan, batch rows (default 1000) per statement so that no statement
// holds many locks or runs long, and returns how many it deleted. olderThan
// must outlast every copy of an event (see Config.Retention); a running
// Consumer calls it with its Retention every hour. inbox_sequences rows
// are kept: they also catch replays older than the retention.
func deleteProcessed(ctx context.Context, db DB, consumer string, olderThan time.Duration, batch int) (deleted int64, err error) {
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
		// An operator's requeue does not make a copy from another stream
		// an event of this one.
		err = stored(h)
	}
	if err == nil {
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
