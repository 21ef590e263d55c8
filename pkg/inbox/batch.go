package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// Batches. A transaction per delivery costs its BEGIN, its COMMIT and a
// round trip per inbox step; under load that, not the handlers, bounds a
// consumer. A worker therefore takes the deliveries it already has (up to
// Config.BatchSize, never waiting for more, so that a lone delivery costs no
// latency) and applies them in one transaction: one pipelined round trip
// records every event and begins the transaction, the handlers run in
// stream order (one worker holds all of an aggregate's events, so
// per-aggregate order holds), one commit, then the acks.
//
// Only the plain case is batched: every event new and due. A duplicate, an
// early or conflicting event, a parked successor to release, a message that
// breaks the contract, a handler that fails — anything else rolls the batch
// back, and the worker handles the same deliveries one at a time, exactly
// as it would without batches: one bad message is isolated as before and
// never takes its neighbours to the dead-letter store.

// take collects, after first, what else is waiting in q, up to the batch
// size, without waiting. It reports false when q is closed (first is then
// the last delivery).
func (c *Consumer) take(first *delivery, q <-chan *delivery) []*delivery {
	batch := []*delivery{first}
	for len(batch) < c.cfg.BatchSize {
		select {
		case d, ok := <-q:
			if !ok {
				return batch
			}
			batch = append(batch, d)
		default:
			return batch
		}
	}
	return batch
}

// handleBatch applies batch in one transaction when it can, else one
// delivery at a time.
func (c *Consumer) handleBatch(ctx context.Context, batch []*delivery) {
	if len(batch) == 1 {
		c.handle(ctx, batch[0])
		return
	}
	start := time.Now()
	metas := make([]*jetstream.MsgMetadata, len(batch))
	plain := true
	for i, d := range batch {
		meta, err := d.msg.Metadata()
		metas[i] = meta
		plain = plain && err == nil && d.err == nil
	}
	done := false
	if plain {
		var err error
		done, err = c.transactBatch(ctx, batch, metas)
		if errors.Is(err, errCrashed) {
			return // as if the process died: nothing acked, all redelivered
		}
		if err != nil {
			c.log.Debug("inbox batch not applied as one; one delivery at a time", "deliveries", len(batch), "err", err)
		}
	}
	if !done {
		for _, d := range batch {
			c.handle(ctx, d)
		}
		return
	}
	// Failure window: the batch is committed, nothing is acked. Every
	// delivery is redelivered and absorbed as a duplicate.
	if c.crashedBatch(afterCommit, batch) {
		return
	}
	c.stats.processed.Add(int64(len(batch)))
	c.stats.batches.Add(1)
	for _, d := range batch {
		if c.cfg.ObserveFunc != nil {
			c.cfg.ObserveFunc(c.cfg.Name, time.Since(start))
		}
		if err := d.msg.Ack(); err != nil {
			c.log.Warn("inbox ack failed; the event will be redelivered and skipped", "event_id", d.m.EventID, "err", err)
		}
	}
}

// errNotPlain rolls a batch back to be handled one delivery at a time.
var errNotPlain = errors.New("inbox: not every event of the batch is new and due")

// transactBatch applies batch in one transaction if every event is new and
// due and every handler succeeds. It reports whether it committed; when it
// did not, it changed nothing.
func (c *Consumer) transactBatch(ctx context.Context, batch []*delivery, metas []*jetstream.MsgMetadata) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
	defer cancel()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	for _, d := range batch {
		sql, args := c.recordStatement(d.m)
		b.Queue(sql, args...)
	}
	br := c.pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) // no-op after commit; undoes everything otherwise
	_, err := br.Exec()
	for range batch {
		if err != nil {
			break
		}
		var recorded, parkedNext bool
		if err = br.QueryRow().Scan(&recorded, &parkedNext); err == nil && (!recorded || parkedNext) {
			err = errNotPlain
		}
	}
	if err = errors.Join(err, br.Close()); err != nil {
		return false, fmt.Errorf("record a batch of %d: %w", len(batch), err)
	}
	for i, d := range batch {
		if err := c.applyHandler(ctx, tx, d.m, metas[i].NumDelivered > 1); err != nil {
			return false, err
		}
	}
	// Failure window: every effect is in the transaction, none committed.
	if c.crashedBatch(beforeCommit, batch) {
		return false, errCrashed
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("commit a batch of %d: %w", len(batch), err)
	}
	return true, nil
}

// crashedBatch is crashed for a batch: the process dies once for all of it
// (one failpoint hit), or where the test hook says it dies for any of its
// events.
func (c *Consumer) crashedBatch(p crashPoint, batch []*delivery) bool {
	if c.crash != nil {
		for _, d := range batch {
			if c.crash(p, d.m) {
				return true
			}
		}
	}
	return c.failpointCrashed(p, batch[0].m)
}
