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

// The parking lot. An event that arrives before an earlier event of its
// aggregate (a relay retry overtaken, a dead-lettered predecessor, a forged
// message) used to be NAKed with a delay and stay in the durable consumer's
// ack-pending set, which every aggregate shares: enough of them stopped
// every delivery. It is parked in inbox_parked instead, and acked. The event
// that fills the gap applies the parked ones in order, in its own
// transaction (drainParked); a sweeper applies any that were left behind
// (sweepParked): a handler of a parked event that failed, a gap filled by an
// event no handler wanted, a race between parking and filling.

// park stores an early delivery in inbox_parked, under the lock of its
// aggregate's cursor: the event that fills the gap updates that row, so it
// cannot commit between this transaction's look at the cursor and its
// insert. It returns parked; duplicate when the same event is parked
// already; conflict when another event is parked at the sequence; or, when
// the cursor moved meanwhile, the verdict of the inbox steps run again.
func (c *Consumer) park(ctx context.Context, d *delivery, meta *jetstream.MsgMetadata) (verdict, error) {
	for range 3 {
		v, again, err := c.parkOnce(ctx, d, meta)
		if err != nil || !again {
			return v, err
		}
		if v, err = c.steps(ctx, d, meta); err != nil || v.out != gap {
			return v, err
		}
	}
	return verdict{}, errors.New("inbox: the aggregate's cursor kept moving while parking")
}

func (c *Consumer) parkOnce(ctx context.Context, d *delivery, meta *jetstream.MsgMetadata) (verdict, bool, error) {
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return verdict{}, false, fmt.Errorf("begin tx to park: %w", err)
	}
	defer tx.Rollback(ctx)
	v, again, err := c.parkIn(ctx, tx, d, meta)
	if err != nil || again || v.out != parked {
		return v, again, err
	}
	if err := tx.Commit(ctx); err != nil {
		return verdict{}, false, fmt.Errorf("commit parked event: %w", err)
	}
	return v, false, nil
}

// parkIn parks d in tx, in one round trip: it creates the cursor row at 0
// if there is none (seq 1 has not come: the lock needs a row), locks it,
// and inserts the parked row only while the event is still early. The
// caller commits when the verdict is parked. again says the gap is gone:
// run the inbox steps again.
func (c *Consumer) parkIn(ctx context.Context, tx pgx.Tx, d *delivery, meta *jetstream.MsgMetadata) (v verdict, again bool, err error) {
	b := &pgx.Batch{}
	if err := c.queuePark(b, d, meta); err != nil {
		return verdict{}, false, err
	}
	br := tx.SendBatch(ctx, b)
	last, tag, err := readPark(br)
	if err = errors.Join(err, br.Close()); err != nil {
		return verdict{}, false, fmt.Errorf("park event: %w", err)
	}
	m := d.m
	switch {
	case m.Seq <= last+1:
		return verdict{}, true, nil // the gap is gone: not early any more
	case tag.RowsAffected() == 1:
		return verdict{out: parked}, false, nil
	}
	// Taken by an open parked event.
	var other uuid.UUID
	if err := tx.QueryRow(ctx, `SELECT event_id FROM inbox_parked
		WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4 AND aggregate_seq = $5`,
		c.cfg.Name, source(m.Subject), m.AggregateType, m.AggregateID, m.Seq).Scan(&other); err != nil {
		return verdict{}, false, fmt.Errorf("read parked event: %w", err)
	}
	if other == m.EventID {
		return verdict{out: duplicate}, false, nil
	}
	return verdict{out: conflict, appliedAs: other}, false, nil
}

// queuePark queues into b the three statements that park d: the cursor
// row at 0 if there is none (seq 1 has not come: the lock needs a row), the
// lock on it, and the parked row, inserted only while the event is still
// early. readPark reads their answers.
func (c *Consumer) queuePark(b *pgx.Batch, d *delivery, meta *jetstream.MsgMetadata) error {
	m := d.m
	headers, err := json.Marshal(cmpHeader(d.msg.Headers()))
	if err != nil {
		return Poison(fmt.Errorf("encode headers to park: %w", err))
	}
	key := []any{c.cfg.Name, source(m.Subject), m.AggregateType, m.AggregateID}
	b.Queue(`INSERT INTO inbox_sequences (consumer_name, source, aggregate_type, aggregate_id, last_seq)
		VALUES ($1, $2, $3, $4, 0) ON CONFLICT DO NOTHING`, key...)
	b.Queue(`SELECT last_seq FROM inbox_sequences
		WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4 FOR UPDATE`, key...)
	// A discarded event at the sequence gives way to this one.
	b.Queue(`
		INSERT INTO inbox_parked AS p (consumer_name, source, aggregate_type, aggregate_id, aggregate_seq, event_id,
			stream, stream_seq, subject, headers, payload)
		SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11
		WHERE (SELECT last_seq FROM inbox_sequences
		       WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4) + 1 < $5
		ON CONFLICT (consumer_name, source, aggregate_type, aggregate_id, aggregate_seq) DO UPDATE
		SET event_id = EXCLUDED.event_id, stream = EXCLUDED.stream, stream_seq = EXCLUDED.stream_seq,
		    subject = EXCLUDED.subject, headers = EXCLUDED.headers, payload = EXCLUDED.payload,
		    parked_at = now(), discarded_at = NULL, discard_reason = NULL
		WHERE p.discarded_at IS NOT NULL`,
		append(key, m.Seq, m.EventID, meta.Stream, int64(meta.Sequence.Stream), d.msg.Subject(), string(headers),
			append([]byte{}, d.msg.Data()...))...)
	return nil
}

// readPark reads the answers of queuePark's statements: the cursor it
// locked, and whether the parked row went in.
func readPark(br pgx.BatchResults) (last int64, tag pgconn.CommandTag, err error) {
	if _, err = br.Exec(); err != nil {
		return 0, tag, err
	}
	if err = br.QueryRow().Scan(&last); err != nil {
		return 0, tag, err
	}
	tag, err = br.Exec()
	return last, tag, err
}

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

// Parked is an event waiting in the parking lot for an earlier event of
// its aggregate, as an operator sees it.
type Parked struct {
	Consumer      string
	Source        string // the producer: the first token of the subject
	AggregateType string
	AggregateID   string
	Seq           int64
	EventID       uuid.UUID
	Stream        string
	StreamSeq     uint64
	Subject       string
	Header        nats.Header
	Data          []byte
	ParkedAt      time.Time
	WaitsFor      int64 // the sequence its aggregate needs next (its cursor + 1)
}

// ParkedStats counts the open parked events of consumer ("" for every
// consumer) and gives the time the oldest was parked (zero when none).
func ParkedStats(ctx context.Context, db DB, consumer string) (n int64, oldest time.Time, err error) {
	var at *time.Time
	err = db.QueryRow(ctx, `SELECT count(*), min(parked_at) FROM inbox_parked
		WHERE discarded_at IS NULL AND ($1 = '' OR consumer_name = $1)`, consumer).Scan(&n, &at)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("count parked events: %w", err)
	}
	if at != nil {
		oldest = *at
	}
	return n, oldest, nil
}

// ListParked returns up to limit (default 100) open parked events of
// consumer ("" for every consumer), oldest first.
func ListParked(ctx context.Context, db DB, consumer string, limit int) ([]Parked, error) {
	if limit <= 0 {
		limit = 100
	}
	rows, err := db.Query(ctx, `
		SELECT p.consumer_name, p.source, p.aggregate_type, p.aggregate_id, p.aggregate_seq, p.event_id,
		       p.stream, p.stream_seq, p.subject, p.headers, p.payload, p.parked_at, coalesce(s.last_seq, 0) + 1
		FROM inbox_parked p
		LEFT JOIN inbox_sequences s USING (consumer_name, source, aggregate_type, aggregate_id)
		WHERE p.discarded_at IS NULL AND ($1 = '' OR p.consumer_name = $1)
		ORDER BY p.parked_at
		LIMIT $2`, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("list parked events: %w", err)
	}
	defer rows.Close()
	var out []Parked
	for rows.Next() {
		var (
			p       Parked
			seq     int64
			headers []byte
		)
		if err := rows.Scan(&p.Consumer, &p.Source, &p.AggregateType, &p.AggregateID, &p.Seq, &p.EventID,
			&p.Stream, &seq, &p.Subject, &headers, &p.Data, &p.ParkedAt, &p.WaitsFor); err != nil {
			return nil, fmt.Errorf("scan parked event: %w", err)
		}
		p.StreamSeq = uint64(seq)
		if err := json.Unmarshal(headers, &p.Header); err != nil {
			return nil, fmt.Errorf("parked event %s headers: %w", p.EventID, err)
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list parked events: %w", err)
	}
	return out, nil
}

// DiscardParked drops the open parked event eventID of consumer, keeping
// the row, the time and reason for audit. Its aggregate still waits for the
// missing earlier event; later events of the aggregate park behind it. A
// real event that arrives later at the same sequence takes the discarded
// one's place. It returns [ErrNotFound] if no open parked event has that id.
func DiscardParked(ctx context.Context, db DB, consumer string, eventID uuid.UUID, reason string) error {
	if reason == "" {
		return errors.New("inbox: a discard needs a reason")
	}
	tag, err := db.Exec(ctx, `UPDATE inbox_parked SET discarded_at = now(), discard_reason = $3
		WHERE consumer_name = $1 AND event_id = $2 AND discarded_at IS NULL`, consumer, eventID, reason)
	if err != nil {
		return fmt.Errorf("discard parked event %s: %w", eventID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("discard parked event %s of %s: %w", eventID, consumer, ErrNotFound)
	}
	return nil
}
