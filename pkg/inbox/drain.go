package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// drainParked applies, in tx, the parked events that follow the applied
// event m, in order, each in a savepoint, and returns how many it applied.
// A parked event that does not apply (its handler fails, it conflicts) is
// put back as it was and left to the sweeper, which counts its failures as
// for any delivery: it must not take the event that filled the gap down
// with it.
func (c *Consumer) drainParked(ctx context.Context, tx pgx.Tx, m Message) (int, error) {
	key := parkKey{source(m.Subject), m.AggregateType, m.AggregateID}
	for n, next := 0, m.Seq+1; ; n, next = n+1, next+1 {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return n, fmt.Errorf("savepoint for a parked event: %w", err)
		}
		pl, ok, err := c.takeParked(ctx, sp, key, next)
		if err != nil || !ok {
			_ = sp.Rollback(ctx)
			return n, err
		}
		// Its own span, a child of its own producer's: it shares the gap
		// filler's transaction, not its trace.
		pctx, span := c.startSpan(ctx, pl.m, pathParked, 1)
		v, err := c.record(pctx, sp, pl.m)
		if err == nil && v.out == applied {
			err = c.applyHandler(pctx, sp, pl.m, false)
		}
		endSpan(span, v.out, err)
		if err != nil && !counts(err) && !errors.Is(err, errIDReused) {
			_ = sp.Rollback(ctx)
			return n, err // the database: the whole transaction is retried
		}
		if err != nil || v.out != applied {
			c.log.Debug("inbox parked event not applied with its predecessor; the sweeper takes it",
				"event_id", pl.m.EventID, "seq", pl.m.Seq, "err", err)
			return n, sp.Rollback(ctx)
		}
		if err := sp.Commit(ctx); err != nil {
			return n, fmt.Errorf("release savepoint for a parked event: %w", err)
		}
		if !v.parkedNext {
			return n + 1, nil
		}
	}
}

// parkKey names an aggregate of a producer.
type parkKey struct{ source, aggregateType, aggregateID string }

// takeParked removes the open parked event at seq of key, in tx, and
// returns it.
func (c *Consumer) takeParked(ctx context.Context, tx pgx.Tx, key parkKey, seq int64) (letter, bool, error) {
	var (
		l       letter
		seqNo   int64
		headers []byte
	)
	err := tx.QueryRow(ctx, `
		DELETE FROM inbox_parked
		WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4
		  AND aggregate_seq = $5 AND discarded_at IS NULL
		RETURNING stream, stream_seq, subject, headers, payload`,
		c.cfg.Name, key.source, key.aggregateType, key.aggregateID, seq).Scan(&l.stream, &seqNo, &l.subject, &headers, &l.data)
	if errors.Is(err, pgx.ErrNoRows) {
		return letter{}, false, nil
	}
	if err != nil {
		return letter{}, false, fmt.Errorf("take parked event: %w", err)
	}
	l.streamSeq = uint64(seqNo)
	if err := json.Unmarshal(headers, &l.header); err != nil {
		return letter{}, false, fmt.Errorf("parked event headers: %w", err)
	}
	if l.m, err = decode(l.subject, l.header, l.data); err != nil {
		return letter{}, false, fmt.Errorf("parked event: %w", err) // it decoded when parked
	}
	return l, true, nil
}

// drainAfter applies, in a transaction of its own, what is parked behind
// m, an event no handler wanted whose one statement has committed.
func (c *Consumer) drainAfter(ctx context.Context, m Message) error {
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin tx for parked events: %w", err)
	}
	defer tx.Rollback(ctx)
	n, err := c.drainParked(ctx, tx, m)
	if err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit parked events: %w", err)
	}
	c.stats.processed.Add(int64(n))
	return nil
}

// sweepParked settles the parked events whose gap is gone (their sequence is
// at most the cursor's next), up to 100 per call: applied, with what is
// parked behind them; or, when their handler fails, counted as a failed
// attempt (backoff, then a dead letter, as for a delivery); a duplicate is
// dropped, a conflict dead-lettered. Events whose gap is still open stay:
// they are what waits.
func (c *Consumer) sweepParked(ctx context.Context) {
	rows, err := c.pool.Query(ctx, `
		SELECT p.source, p.aggregate_type, p.aggregate_id, p.aggregate_seq
		FROM inbox_parked p
		JOIN inbox_sequences s USING (consumer_name, source, aggregate_type, aggregate_id)
		LEFT JOIN inbox_failures f ON f.consumer_name = p.consumer_name AND f.event_id = p.event_id
		WHERE p.consumer_name = $1 AND p.discarded_at IS NULL AND p.aggregate_seq <= s.last_seq + 1
		  AND (f.event_id IS NULL OR f.last_failed_at
		       + least($2::bigint, $3::bigint * (2 ^ least(f.attempts - 1, 30))::bigint) * interval '1 microsecond' <= now())
		ORDER BY p.parked_at
		LIMIT 100`, c.cfg.Name, c.cfg.BackoffMax.Microseconds(), c.cfg.BackoffBase.Microseconds())
	if err != nil {
		if ctx.Err() == nil {
			c.log.Error("inbox sweep of parked events failed", "err", err)
		}
		return
	}
	type due struct {
		key parkKey
		seq int64
	}
	var dues []due
	for rows.Next() {
		var d due
		if err := rows.Scan(&d.key.source, &d.key.aggregateType, &d.key.aggregateID, &d.seq); err != nil {
			rows.Close()
			c.log.Error("inbox sweep of parked events failed", "err", err)
			return
		}
		dues = append(dues, d)
	}
	rows.Close()
	for _, d := range dues {
		if ctx.Err() != nil {
			return
		}
		if err := c.settleParked(ctx, d.key, d.seq); err != nil && ctx.Err() == nil {
			c.log.Error("inbox parked event not settled; will retry", "aggregate_id", d.key.aggregateID, "seq", d.seq, "err", err)
		}
	}
}

// settleParked applies the parked event at seq of key as a delivery would
// be applied, in a transaction of its own, and records what became of it.
func (c *Consumer) settleParked(ctx context.Context, key parkKey, seq int64) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
	defer cancel()
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin parked event tx: %w", err)
	}
	defer tx.Rollback(ctx)
	l, ok, err := c.takeParked(ctx, tx, key, seq)
	if err != nil || !ok {
		return err // gone: settled by another instance or drained meanwhile
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("savepoint for a parked event: %w", err)
	}
	pctx, span := c.startSpan(ctx, l.m, pathParked, 1)
	v, err := c.apply(pctx, sp, l.m, true)
	if errors.Is(err, errIDReused) {
		v, err = verdict{out: duplicate}, nil
	}
	endSpan(span, v.out, err)
	switch {
	case err != nil && !counts(err):
		return err
	case err != nil:
		// The handler failed: the parked row stays (tx rolls back) and the
		// failure is counted; the last one turns it into a dead letter.
		_ = tx.Rollback(ctx)
		_, dead, ferr := c.recordFailure(ctx, l, err, func(ftx pgx.Tx) error { return deleteParked(ctx, ftx, c.cfg.Name, key, seq) })
		if ferr != nil {
			return ferr
		}
		c.stats.retries.Add(1)
		if dead {
			c.stats.deadLetters.Add(1)
			c.log.Error("inbox parked event dead-lettered", "event_id", l.m.EventID, "seq", seq, "err", err)
		}
		return nil
	case v.out == conflict:
		_ = tx.Rollback(ctx)
		cause := fmt.Errorf("%w: sequence %d of %s %q was applied as event %s; this parked event is %s",
			ErrConflict, seq, cmpOr(key.aggregateType, "aggregate"), key.aggregateID, v.appliedAs, l.m.EventID)
		return c.deadLetterConflict(ctx, l, cause, v.appliedAs, func(ftx pgx.Tx) error { return deleteParked(ctx, ftx, c.cfg.Name, key, seq) })
	case v.out == gap:
		return nil // the cursor moved back? it stays parked (tx rolls back)
	case v.out != applied:
		// A duplicate or stale copy: it leaves the lot, nothing else changes.
		if err := sp.Rollback(ctx); err != nil {
			return fmt.Errorf("roll back parked duplicate: %w", err)
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("commit parked duplicate: %w", err)
		}
		c.stats.duplicates.Add(1)
		return nil
	}
	if err := sp.Commit(ctx); err != nil {
		return fmt.Errorf("release savepoint for a parked event: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit parked event: %w", err)
	}
	c.stats.processed.Add(int64(1 + v.drained))
	return nil
}

func deleteParked(ctx context.Context, tx pgx.Tx, consumer string, key parkKey, seq int64) error {
	_, err := tx.Exec(ctx, `DELETE FROM inbox_parked
		WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4 AND aggregate_seq = $5`,
		consumer, key.source, key.aggregateType, key.aggregateID, seq)
	if err != nil {
		return fmt.Errorf("delete parked event: %w", err)
	}
	return nil
}
