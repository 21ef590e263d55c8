package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
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
// What is not new is settled in the same transaction: copies absorbed,
// early events parked, each kind in one round trip for the whole batch. A
// conflict is left to be dead-lettered on its own, after the commit. A
// parked successor to release, a message that breaks the contract, a
// handler that fails — these roll the batch back, and the worker handles
// the same deliveries one at a time, exactly as it would without batches:
// one bad message is isolated as before and never takes its neighbours to
// the dead-letter store.

// take collects, after first, what else is waiting in q, up to the batch
// size, without waiting. When q is closed it returns what it has collected.
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
	var outs []outcome
	if plain {
		// A span per delivery, each the child of its own producer, all
		// over the one transaction they share (see the package
		// documentation).
		spans := make([]trace.Span, len(batch))
		for i, d := range batch {
			_, spans[i] = c.startSpan(ctx, d.m, pathBatch, len(batch))
		}
		var err error
		outs, err = c.transactBatch(ctx, batch, metas, spans)
		for i, span := range spans {
			switch {
			case outs != nil:
				endSpan(span, outs[i], nil)
			case errors.Is(err, errCrashed):
				endSpan(span, 0, err)
			default:
				// Not an error of this event's: the batch is rolled back
				// and every delivery applied alone, under a span of its own.
				span.AddEvent("batch rolled back; applied alone", trace.WithAttributes(attribute.String("reason", fmt.Sprint(err))))
				span.End()
			}
		}
		if errors.Is(err, errCrashed) {
			return // as if the process died: nothing acked, all redelivered
		}
		if err != nil {
			c.log.Debug("inbox batch not applied as one; one delivery at a time", "deliveries", len(batch), "err", err)
		}
	}
	if outs == nil {
		for _, d := range batch {
			c.handle(ctx, d)
		}
		return
	}
	// Failure window: the batch is committed, nothing is acked. Every
	// delivery is redelivered and absorbed as a duplicate (or finds itself
	// parked already).
	if c.crashedBatch(afterCommit, batch) {
		return
	}
	c.stats.batches.Add(1)
	for i, d := range batch {
		switch outs[i] {
		case applied:
			c.stats.processed.Add(1)
		case duplicate:
			c.stats.duplicates.Add(1)
		case stale:
			c.stats.stale.Add(1)
		case parked:
			c.stats.parked.Add(1)
		default:
			// Left for one at a time: a conflict to dead-letter, an event
			// parked at its sequence already, a cursor that moved meanwhile.
			c.handle(ctx, d)
			continue
		}
		c.observe(start)
		if err := d.msg.Ack(); err != nil {
			c.log.Warn("inbox ack failed; the event will be redelivered and skipped", "event_id", d.m.EventID, "err", err)
		}
	}
}

// errNotPlain rolls a batch back to be handled one delivery at a time.
var errNotPlain = errors.New("inbox: an event of the batch releases parked events")

// left marks a delivery transactBatch did not settle.
const left outcome = -1

// transactBatch settles batch in one transaction: the events that are new
// and due are applied (their handlers in stream order), and, in the same
// transaction, what the others are is found out in one more round trip —
// duplicates and stale copies change nothing, early events are parked (one
// more round trip for all of them). It returns each delivery's outcome, or
// left for one to be handled alone afterwards (a conflict, which is
// dead-lettered in a transaction of its own; an event whose place in the
// parking lot is taken). It returns nil outcomes, having changed nothing,
// when a handler fails or an applied event releases parked ones: the
// caller then handles every delivery alone.
func (c *Consumer) transactBatch(ctx context.Context, batch []*delivery, metas []*jetstream.MsgMetadata, spans []trace.Span) ([]outcome, error) {
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
	outs := make([]outcome, len(batch))
	var others []int // not recorded: classify them
	_, err := br.Exec()
	for i := range batch {
		if err != nil {
			break
		}
		var recorded, parkedNext bool
		err = br.QueryRow().Scan(&recorded, &parkedNext)
		switch {
		case err != nil:
		case parkedNext:
			err = errNotPlain
		case recorded:
			outs[i] = applied
		case c.cfg.SkipSequenceCheck:
			outs[i] = duplicate
		default:
			others = append(others, i)
		}
	}
	if err = errors.Join(err, br.Close()); err != nil {
		return nil, fmt.Errorf("record a batch of %d: %w", len(batch), err)
	}
	if len(others) > 0 {
		if err := c.settleOthers(ctx, tx, batch, metas, others, outs); err != nil {
			return nil, err
		}
	}
	if err := c.applyHandlers(ctx, tx, batch, metas, spans, outs); err != nil {
		return nil, err
	}
	// Failure window: every effect is in the transaction, none committed.
	if c.crashedBatch(beforeCommit, batch) {
		return nil, errCrashed
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("commit a batch of %d: %w", len(batch), err)
	}
	return outs, nil
}

// applyHandlers hands the batch's applied deliveries of the types it
// handles to the handler in one call, in stream order, and clears the
// failure records of those that had failed before.
func (c *Consumer) applyHandlers(ctx context.Context, tx pgx.Tx, batch []*delivery, metas []*jetstream.MsgMetadata, spans []trace.Span, outs []outcome) error {
	var (
		handled []Batched
		retried []uuid.UUID
	)
	for i, d := range batch {
		if outs[i] != applied {
			continue
		}
		if c.handles(d.m.Type) {
			// The handler sees each delivery's own span: the events it
			// writes continue their producer's trace, not a neighbour's.
			handled = append(handled, Batched{Message: d.m, Ctx: trace.ContextWithSpan(ctx, spans[i])})
		}
		if metas[i].NumDelivered > 1 {
			retried = append(retried, d.m.EventID)
		}
	}
	if len(handled) > 0 {
		if err := c.callHandler(ctx, tx, handled); err != nil {
			return attemptError{err}
		}
	}
	if len(retried) > 0 {
		if _, err := tx.Exec(ctx,
			`DELETE FROM inbox_failures WHERE consumer_name = $1 AND event_id = ANY($2)`,
			c.cfg.Name, retried); err != nil {
			return fmt.Errorf("clear inbox failures: %w", err)
		}
	}
	return nil
}

// settleOthers classifies, in tx, the deliveries at idx that record did
// not apply, in one round trip, and parks the early ones in one more. It
// sets their outcomes in outs: duplicate, stale, parked, or left.
func (c *Consumer) settleOthers(ctx context.Context, tx pgx.Tx, batch []*delivery, metas []*jetstream.MsgMetadata, idx []int, outs []outcome) error {
	b := &pgx.Batch{}
	for _, i := range idx {
		b.Queue(classifySQL, c.classifyArgs(batch[i].m)...)
	}
	br := tx.SendBatch(ctx, b)
	var gaps []int
	for _, i := range idx {
		v, err := c.classified(br.QueryRow(), batch[i].m)
		if err != nil {
			br.Close()
			return err
		}
		switch v.out {
		case duplicate, stale:
			outs[i] = v.out
		case gap:
			gaps = append(gaps, i)
		default:
			outs[i] = left // a conflict: dead-lettered alone
		}
	}
	if err := br.Close(); err != nil {
		return fmt.Errorf("classify %d events of a batch: %w", len(idx), err)
	}
	if len(gaps) == 0 {
		return nil
	}
	b = &pgx.Batch{}
	for _, i := range gaps {
		if err := c.queuePark(b, batch[i], metas[i]); err != nil {
			return err
		}
	}
	br = tx.SendBatch(ctx, b)
	defer br.Close()
	for _, i := range gaps {
		outs[i] = left
		last, tag, err := readPark(br)
		if err != nil {
			return fmt.Errorf("park events of a batch: %w", err)
		}
		if batch[i].m.Seq > last+1 && tag.RowsAffected() == 1 {
			outs[i] = parked
		}
	}
	return br.Close()
}
