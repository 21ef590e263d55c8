package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// failed records a failed attempt and settles the message: redeliver after
// a backoff, or dead-letter and terminate when the failure is poison or
// attempts reached MaxDeliver.
func (c *Consumer) failed(ctx context.Context, d *delivery, meta *jetstream.MsgMetadata, cause error) {
	log := c.log.With("subject", d.msg.Subject(), "event_id", d.m.EventID, "stream_seq", meta.Sequence.Stream)
	var a attemptError
	if !errors.As(cause, &a) && !errors.Is(cause, ErrPoison) && dataError(cause) {
		cause = Poison(fmt.Errorf("the inbox tables cannot hold this message: %w", cause))
	}
	if !counts(cause) {
		// The inbox steps before the handler failed: the database is down
		// or overloaded. Retry, but do not count it: an outage must not turn
		// every event in flight into a dead letter.
		delay := c.backoff(int(min(meta.NumDelivered, 64)))
		c.stats.retries.Add(1)
		log.Error("inbox transaction failed before the handler; will retry", "err", cause, "delay", delay)
		_ = d.msg.NakWithDelay(delay)
		return
	}
	attempts, dead, err := c.recordFailure(ctx, letterOf(d, meta), cause, nil)
	if err != nil {
		// Cannot even write down the failure: the database is likely down.
		// Retry later; this delivery does not count as an attempt.
		delay := c.backoff(int(min(meta.NumDelivered, 64)))
		c.stats.retries.Add(1)
		log.Error("inbox failure not recorded; will retry", "err", err, "cause", cause, "delay", delay)
		_ = d.msg.NakWithDelay(delay)
		return
	}
	if dead {
		c.stats.deadLetters.Add(1)
		log.Error("inbox event dead-lettered", "attempts", attempts, "err", cause)
		// Should the Term be lost, the redelivered copy fails again and
		// updates the same dead letter (unique per stream sequence).
		_ = d.msg.Term()
		return
	}
	delay := c.backoff(attempts)
	c.stats.retries.Add(1)
	log.Warn("inbox handler failed; will retry", "attempts", attempts, "delay", delay, "err", cause)
	_ = d.msg.NakWithDelay(delay)
}

// attemptError is a failure of the handler's part of the transaction (its
// error, a panic, the commit): it counts towards MaxDeliver.
type attemptError struct{ err error }

func (e attemptError) Error() string { return e.err.Error() }

func (e attemptError) Unwrap() error { return e.err }

// counts reports whether a failure counts towards MaxDeliver: the
// handler's (an attempt), poison, or anything else that is not the
// database failing around the message. Only an outage waits uncounted;
// a failure of the inbox's own steps that is about the message (a value
// the tables refuse) would otherwise be retried for ever.
func counts(err error) bool {
	var a attemptError
	return errors.Is(err, ErrPoison) || errors.As(err, &a) || !outage(err)
}

// outage reports whether err is the database failing rather than the
// statement: unreachable, the connection lost, out of connections or
// resources, shutting down or starting, a statement cancelled or timed
// out, or two transactions colliding (serialization, deadlock), which a
// retry resolves. The consumer's own context ending is one too.
func outage(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code[:2] {
		case "08", // connection exception
			"40", // transaction rollback: serialization failure, deadlock
			"53", // insufficient resources: too many connections, disk full
			"57", // operator intervention: shutdown, starting up, query cancelled
			"58": // system error: I/O
			return true
		}
		return false
	}
	var netErr net.Error
	var connErr *pgconn.ConnectError
	return errors.As(err, &netErr) || errors.As(err, &connErr) || pgconn.Timeout(err) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, pgconn.ErrConnClosed)
}

// dataError reports whether err is Postgres refusing a value (SQLSTATE
// class 22: out of range, not valid in the encoding, …) or pgx unable to
// encode one: in the inbox's own steps, a message whose values the tables
// cannot hold, which no retry changes.
func dataError(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "22")
	}
	return strings.Contains(err.Error(), "unable to encode")
}

// backoff is the delay before attempt+1: exponential, capped, with full
// jitter so that many failing events do not return in lockstep.
func (c *Consumer) backoff(attempt int) time.Duration {
	return rand.N(grow(c.cfg.BackoffBase, c.cfg.BackoffMax, attempt)) + 1
}

// grow doubles base for each step after the first, up to limit.
func grow(base, limit time.Duration, n int) time.Duration {
	d := base
	for i := 1; i < n && d < limit; i++ {
		d *= 2
	}
	return min(d, limit)
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
	return letter{stream: meta.Stream, streamSeq: meta.Sequence.Stream, subject: storable(d.msg.Subject()),
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
			c.cfg.Name, l.m.EventID, storable(cause.Error())).Scan(&attempts, &f); err != nil {
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
	headers, err := json.Marshal(storableHeader(l.header))
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
		storable(cause.Error()), attempts, first, conflictWith); err != nil {
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
