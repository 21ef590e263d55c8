package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The inbox steps: what one event does to the inbox tables, inside the
// transaction of its handler (or alone, for an event no handler wants).

// outcome is how far the inbox steps got with one event.
type outcome int

const (
	applied   outcome = iota // the handler ran; commit
	duplicate                // this consumer already processed this event id; commit, nothing changed
	stale                    // a new id at a passed sequence whose record is gone (older than Retention); commit, nothing changed
	conflict                 // another event was applied at this sequence: dead-letter it, never drop it as a duplicate
	gap                      // an earlier event of the aggregate has not been applied yet: park it
	parked                   // parked: acked, applied when the gap before it is filled
)

// verdict is what the inbox steps found for one event.
type verdict struct {
	out        outcome
	parkedNext bool      // applied, and the next sequence of its aggregate is parked
	drained    int       // parked events applied after it, in its transaction
	appliedAs  uuid.UUID // conflict: the event applied at this sequence
}

// apply runs the inbox steps for m inside tx and, when m is applied, the
// parked events that follow it (see drainParked). It is the path of an
// event from JetStream, from a requeued dead letter and from the parking
// lot alike. An error means the handler (or the database) failed and tx
// must be rolled back. retried says the event failed before, so its
// failure record goes.
func (c *Consumer) apply(ctx context.Context, tx pgx.Tx, m Message, retried bool) (verdict, error) {
	v, err := c.record(ctx, tx, m)
	if err != nil || v.out != applied {
		return v, err
	}
	return c.applyRecorded(ctx, tx, m, v, retried)
}

// applyRecorded runs the rest of apply once record has said applied: the
// handler, the failure record, the parked successors.
func (c *Consumer) applyRecorded(ctx context.Context, tx pgx.Tx, m Message, v verdict, retried bool) (verdict, error) {
	if err := c.applyHandler(ctx, tx, m, retried); err != nil {
		return v, err
	}
	if v.parkedNext {
		n, err := c.drainParked(ctx, tx, m)
		if err != nil {
			return v, err
		}
		v.drained = n
	}
	return v, nil
}

// applyHandler calls the handler for a recorded event and clears its
// failure record.
func (c *Consumer) applyHandler(ctx context.Context, tx pgx.Tx, m Message, retried bool) error {
	if c.handles(m.Type) {
		if err := c.callHandler(ctx, tx, []Batched{{Message: m, Ctx: ctx}}); err != nil {
			return attemptError{err}
		}
	}
	if retried {
		if _, err := tx.Exec(ctx,
			`DELETE FROM inbox_failures WHERE consumer_name = $1 AND event_id = $2`,
			c.cfg.Name, m.EventID); err != nil {
			return fmt.Errorf("clear inbox failures: %w", err)
		}
	}
	return nil
}

// handles reports whether the handler wants events of type t.
func (c *Consumer) handles(t string) bool {
	return c.types == nil || c.types[t]
}

// record advances the aggregate's cursor from m.Seq-1 to m.Seq and inserts
// the processed_events row (with the sequence it applied), in one
// statement: one round trip, where locking the cursor, checking it,
// advancing it and inserting the row used to take four. The same statement
// says whether the next sequence is parked. On a transaction (the
// handler's) it commits with the handler's effects; on the pool (an event no
// handler wants) it commits alone.
//
// The cursor UPDATE only matches while last_seq is m.Seq-1. A second copy of
// the event in flight at the same time (another instance, a redelivery)
// queues on the cursor's row lock and, once the first commits, re-reads
// last_seq (READ COMMITTED re-checks the WHERE of an updated row), no longer
// matches and changes nothing. The same holds for the first event of an
// aggregate, whose cursor row the INSERT creates: the second copy waits on
// the first one's uncommitted row.
func (c *Consumer) record(ctx context.Context, db querier, m Message) (verdict, error) {
	sql, args := c.recordStatement(m)
	var recorded, parkedNext bool
	err := db.QueryRow(ctx, sql, args...).Scan(&recorded, &parkedNext)
	return c.recorded(ctx, db, m, recorded, parkedNext, err)
}

// recordStatement is the statement of record for m.
func (c *Consumer) recordStatement(m Message) (string, []any) {
	switch {
	case c.cfg.SkipSequenceCheck:
		return insertProcessedSQL, []any{c.cfg.Name, m.EventID}
	case m.Seq == 1:
		return firstEventSQL, []any{c.cfg.Name, source(m.Subject), m.AggregateType, m.AggregateID, m.EventID}
	default:
		return nextEventSQL, []any{c.cfg.Name, source(m.Subject), m.AggregateType, m.AggregateID, m.EventID, m.Seq}
	}
}

// recorded turns the result of m's record statement into a verdict. A
// unique violation means the event id is processed already at another
// sequence (the statement is atomic: the cursor did not move); in a
// transaction it aborts the transaction, so the caller classifies again on
// the pool (see transact).
func (c *Consumer) recorded(ctx context.Context, db querier, m Message, recorded, parkedNext bool, err error) (verdict, error) {
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "23505":
		return verdict{out: duplicate}, errIDReused
	case err != nil:
		return verdict{}, fmt.Errorf("record processed event: %w", err)
	case recorded:
		return verdict{out: applied, parkedNext: parkedNext}, nil
	case c.cfg.SkipSequenceCheck:
		return verdict{out: duplicate}, nil
	}
	return c.classify(ctx, db, m)
}

// errIDReused is recorded's answer to an event id that was processed at
// another sequence: a duplicate by its id, once the aborted transaction is
// rolled back.
var errIDReused = errors.New("inbox: event id already processed at another sequence")

// classify says why record changed nothing. Rare: only copies, conflicts
// and early arrivals get here. Only the same event id is a duplicate.
func (c *Consumer) classify(ctx context.Context, db querier, m Message) (verdict, error) {
	return c.classified(db.QueryRow(ctx, classifySQL, c.classifyArgs(m)...), m)
}

const classifySQL = `
SELECT coalesce((SELECT last_seq FROM inbox_sequences
                 WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4), 0),
       EXISTS (SELECT 1 FROM processed_events WHERE consumer_name = $1 AND event_id = $5),
       (SELECT event_id FROM processed_events
        WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4 AND aggregate_seq = $6)`

func (c *Consumer) classifyArgs(m Message) []any {
	return []any{c.cfg.Name, source(m.Subject), m.AggregateType, m.AggregateID, m.EventID, m.Seq}
}

// classified reads the answer of classifySQL for m.
func (c *Consumer) classified(row pgx.Row, m Message) (verdict, error) {
	var (
		last      int64
		processed bool
		at        uuid.NullUUID
	)
	err := row.Scan(&last, &processed, &at)
	switch {
	case err != nil:
		return verdict{}, fmt.Errorf("read inbox sequence: %w", err)
	case processed:
		// Crashed after commit before the ack, a lost ack, the relay
		// publishing again, a replay within Retention.
		return verdict{out: duplicate}, nil
	case m.Seq <= last && at.Valid:
		// Another event took this sequence: one of the two is not what
		// the producer wrote. Never dropped quietly.
		return verdict{out: conflict, appliedAs: at.UUID}, nil
	case m.Seq <= last:
		// A new id with a passed sequence whose record is gone: a replay
		// older than Retention (or a row written before the inbox kept
		// sequences). The cursor still knows it is not new.
		return verdict{out: stale}, nil
	default:
		// An earlier event of the aggregate has not been applied yet.
		return verdict{out: gap}, nil
	}
}

// querier is a pgx.Tx or the pool.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

const insertProcessedSQL = `
WITH ins AS (
	INSERT INTO processed_events (consumer_name, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins), false`

// The processed_events row is inserted only when the cursor moved, so a
// copy of an applied event, or an event that arrived too early, changes
// nothing and returns false. A cursor row at 0 is one created by parking
// (or by an older version of this package) before the first event came.
// The result's second column says whether the next sequence is parked.
const (
	firstEventSQL = `
WITH cursor AS (
	INSERT INTO inbox_sequences (consumer_name, source, aggregate_type, aggregate_id, last_seq)
	VALUES ($1, $2, $3, $4, 1)
	ON CONFLICT (consumer_name, source, aggregate_type, aggregate_id)
	DO UPDATE SET last_seq = 1, updated_at = now() WHERE inbox_sequences.last_seq = 0
	RETURNING 1
), ins AS (
	INSERT INTO processed_events (consumer_name, event_id, source, aggregate_type, aggregate_id, aggregate_seq)
	SELECT $1, $5, $2, $3, $4, 1 FROM cursor
	RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins),
       EXISTS (SELECT 1 FROM inbox_parked
               WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4
                 AND aggregate_seq = 2 AND discarded_at IS NULL)`

	nextEventSQL = `
WITH cursor AS (
	UPDATE inbox_sequences SET last_seq = $6, updated_at = now()
	WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4 AND last_seq = $6::bigint - 1
	RETURNING 1
), ins AS (
	INSERT INTO processed_events (consumer_name, event_id, source, aggregate_type, aggregate_id, aggregate_seq)
	SELECT $1, $5, $2, $3, $4, $6 FROM cursor
	RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins),
       EXISTS (SELECT 1 FROM inbox_parked
               WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4
                 AND aggregate_seq = $6::bigint + 1 AND discarded_at IS NULL)`
)
