package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	headers, err := json.Marshal(storableHeader(d.msg.Headers()))
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
		SELECT $1, $2, $3, $4, $5::bigint, $6, $7, $8, $9, $10, $11
		WHERE (SELECT last_seq FROM inbox_sequences
		       WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4) + 1 < $5::bigint
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
