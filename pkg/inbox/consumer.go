package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
)

// Consumer applies the events of one durable JetStream consumer once each
// (see the package doc).
type Consumer struct {
	pool *pgxpool.Pool
	js   jetstream.JetStream
	cfg  Config
	log  *slog.Logger

	types        map[string]bool // Config.Handles; nil: all types
	requeueEvery time.Duration   // how often requeued dead letters are looked for
	cleanupEvery time.Duration   // how often old processed_events rows are deleted
	queueDepth   int             // events waiting per worker
	progress     *progress       // the deliveries this instance holds, reported in progress
	tracer       trace.Tracer    // from Config.TracerProvider
	stats        counters
}

// Name returns the consumer's Config.Name.
func (c *Consumer) Name() string { return c.cfg.Name }

// Stream returns the consumer's Config.Stream.
func (c *Consumer) Stream() string { return c.cfg.Stream }

// Lag asks JetStream how many messages the durable consumer (all its
// instances) has not yet delivered or had acked; before Run created it, the
// error wraps jetstream.ErrConsumerNotFound.
func (c *Consumer) Lag(ctx context.Context) (uint64, error) {
	cons, err := c.js.Consumer(ctx, c.cfg.Stream, c.cfg.Name)
	if err != nil {
		return 0, fmt.Errorf("look up consumer %s on %s: %w", c.cfg.Name, c.cfg.Stream, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("consumer %s info: %w", c.cfg.Name, err)
	}
	return info.NumPending + uint64(max(info.NumAckPending, 0)), nil
}

// NewConsumer checks cfg and returns a Consumer; it does no I/O. The pool
// needs at least cfg.Workers+2 connections.
func NewConsumer(pool *pgxpool.Pool, js jetstream.JetStream, cfg Config) (*Consumer, error) {
	if pool == nil || js == nil {
		return nil, errors.New("inbox: NewConsumer needs a pool and a JetStream context")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	var types map[string]bool
	if len(cfg.Handles) > 0 {
		types = map[string]bool{}
		for _, t := range cfg.Handles {
			types[t] = true
		}
	}
	return &Consumer{
		types:        types,
		pool:         pool,
		js:           js,
		cfg:          cfg,
		log:          cfg.Logger.With("consumer", cfg.Name),
		requeueEvery: time.Second,
		cleanupEvery: time.Hour,
		queueDepth:   max(4, cfg.BatchSize),
		progress:     newProgress(),
		tracer:       cfg.TracerProvider.Tracer("github.com/shop-ref/shop/pkg/inbox"),
	}, nil
}

// delivery is a message from JetStream with its headers decoded.
type delivery struct {
	msg jetstream.Msg
	m   Message
	err error // the message breaks the contract: poison
}

// Run creates or updates the durable consumer and handles its messages until
// ctx ends; then it hands prefetched messages back, lets in-flight
// transactions finish and returns nil. No broker condition ends it. It
// returns an error only when the live stream's duplicate window is not
// shorter than Config.Retention.
func (c *Consumer) Run(ctx context.Context) error {
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	// In-flight transactions finish on shutdown instead of being cut off
	// half way; each is bounded by HandlerTimeout.
	work := context.WithoutCancel(ctx)

	var wg sync.WaitGroup
	queues := make([]chan *delivery, c.cfg.Workers)
	for i := range queues {
		q := make(chan *delivery, c.queueDepth)
		queues[i] = q
		wg.Go(func() {
			for d := range q {
				batch := c.take(d, q)
				if runCtx.Err() != nil {
					for _, d := range batch {
						_ = d.msg.Nak() // not started: let another instance have it now
					}
				} else {
					c.handleBatch(work, batch)
				}
				for _, d := range batch {
					c.progress.release(d)
				}
			}
		})
	}
	wg.Go(func() { c.maintain(runCtx, work) })
	wg.Go(func() { c.progress.run(runCtx, c.cfg.AckWait/3) })

	err := c.consume(ctx, queues)
	stop()
	for _, q := range queues {
		close(q)
	}
	wg.Wait()
	return err
}

// callHandler runs the handler on batch and turns a panic into an error,
// so that one bad event is retried and dead-lettered instead of crashing
// the process again on every redelivery.
func (c *Consumer) callHandler(ctx context.Context, tx pgx.Tx, batch []Batched) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("handler panic: %v\n%s", r, debug.Stack())
		}
	}()
	if err := c.cfg.Handler(ctx, tx, batch); err != nil {
		if len(batch) == 1 {
			return fmt.Errorf("handle %s %s: %w", batch[0].Type, batch[0].EventID, err)
		}
		return fmt.Errorf("handle a batch of %d events: %w", len(batch), err)
	}
	return nil
}

// handle processes one message from JetStream and settles it: ack only
// after commit, so a crash anywhere before leaves the message to be
// redelivered and the inbox row absorbs a redelivery after commit.
func (c *Consumer) handle(ctx context.Context, d *delivery) {
	meta, err := d.msg.Metadata()
	if err != nil { // not a JetStream message; cannot happen on a pull consumer
		c.log.Error("inbox message without metadata", "subject", d.msg.Subject(), "err", err)
		_ = d.msg.Term()
		return
	}
	ctx, span := c.startSpan(ctx, d.m, pathDelivery, 1)
	var (
		out     outcome
		spanErr error
	)
	defer func() { endSpan(span, out, spanErr) }()
	if d.err != nil {
		spanErr = d.err
		c.failed(ctx, d, meta, d.err)
		return
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
	defer cancel()
	// Built only when something is logged: With formats its attributes.
	log := func() *slog.Logger {
		return c.log.With("event_id", d.m.EventID, "type", d.m.Type, "aggregate_id", d.m.AggregateID, "seq", d.m.Seq)
	}

	v, err := c.steps(ctx, d, meta)
	if errors.Is(err, errCrashed) {
		return // as if the process died: neither acked nor nak'ed
	}
	if err == nil && v.out == gap {
		// Early: parked in the database and acked, so that it holds nothing
		// in the broker's ack-pending set, which every aggregate shares.
		v, err = c.park(ctx, d, meta)
	}
	out = v.out
	if err != nil {
		spanErr = err
		c.failed(ctx, d, meta, err)
		return
	}
	if v.out == conflict {
		c.conflicted(ctx, d, meta, v.appliedAs)
		return
	}
	// Failure window: committed, not acked. The redelivery finds the
	// processed_events row and is absorbed as a duplicate.
	if c.crashed(afterCommit, d.m) {
		return
	}
	switch v.out {
	case applied:
		c.stats.processed.Add(int64(1 + v.drained)) // with the parked events it released
	case duplicate:
		c.stats.duplicates.Add(1)
		log().Debug("inbox event already processed")
	case stale:
		c.stats.stale.Add(1)
		log().Warn("inbox event at a passed sequence whose record is gone (older than Retention) skipped")
	case parked:
		c.stats.parked.Add(1)
		log().Debug("inbox event parked until an earlier event of its aggregate is applied")
	}
	c.observe(start)
	// A lost ack only means one more delivery, which the inbox row absorbs.
	if err := d.msg.Ack(); err != nil {
		log().Warn("inbox ack failed; the event will be redelivered and skipped", "err", err)
	}
}

// steps runs the inbox steps of one delivery: in a transaction with the
// handler, or, for an event no handler wants, in one statement that commits
// alone (no transaction to begin and commit; a redelivery takes the
// transaction, which also clears its failure records).
func (c *Consumer) steps(ctx context.Context, d *delivery, meta *jetstream.MsgMetadata) (verdict, error) {
	if c.handles(d.m.Type) || meta.NumDelivered > 1 {
		v, err := c.transact(ctx, d, meta)
		if errors.Is(err, errIDReused) {
			return verdict{out: duplicate}, nil // its transaction is rolled back
		}
		return v, err
	}
	v, err := c.record(ctx, c.pool, d.m)
	if errors.Is(err, errIDReused) {
		return verdict{out: duplicate}, nil
	}
	if err == nil && v.parkedNext {
		// It filled a gap: what waits behind it is applied now, in a
		// transaction of its own. Should that fail, the sweeper applies it.
		if derr := c.drainAfter(ctx, d.m); derr != nil {
			c.log.Warn("inbox parked events not applied yet; the sweeper retries", "aggregate_id", d.m.AggregateID, "err", derr)
		}
	}
	return v, err
}

// errCrashed is returned by transact when a failpoint "killed" the process.
var errCrashed = errors.New("inbox: crashed at a failpoint")

// transact runs the inbox steps and the handler (and the parked events the
// event releases) in one transaction and commits it when the event was
// applied; anything else changes nothing and is rolled back.
func (c *Consumer) transact(ctx context.Context, d *delivery, meta *jetstream.MsgMetadata) (verdict, error) {
	// BEGIN and the record statement travel together: one round trip.
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	sql, args := c.recordStatement(d.m)
	b.Queue(sql, args...)
	br := c.pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) // no-op after commit; undoes everything on an early return
	_, err := br.Exec()
	var (
		recorded, parkedNext bool
		recErr               error
	)
	if err == nil {
		recErr = br.QueryRow().Scan(&recorded, &parkedNext)
	}
	if cerr := br.Close(); err == nil && recErr == nil {
		err = cerr
	}
	if err != nil {
		return verdict{}, fmt.Errorf("begin inbox tx and record processed event: %w", err)
	}
	v, err := c.recorded(ctx, tx, d.m, recorded, parkedNext, recErr)
	if err == nil && v.out == gap {
		// Early: parked in this same transaction, one round trip more.
		var again bool
		if v, again, err = c.parkIn(ctx, tx, d, meta); err == nil && !again && v.out == parked {
			if err := tx.Commit(ctx); err != nil {
				return verdict{}, fmt.Errorf("commit parked event: %w", err)
			}
			return v, nil
		}
		if again {
			return verdict{out: gap}, nil // the caller parks, or finds it due, afresh
		}
	}
	if err != nil || v.out != applied {
		return v, err
	}
	if v, err = c.applyRecorded(ctx, tx, d.m, v, meta.NumDelivered > 1); err != nil {
		return v, err
	}
	// Failure window: the handler's effects are in the transaction, not
	// committed. Dying here rolls them back; the redelivery applies them.
	if c.crashed(beforeCommit, d.m) {
		return verdict{}, errCrashed
	}
	if err := tx.Commit(ctx); err != nil {
		// The commit is part of the attempt: it is the handler's work that fails to commit.
		return verdict{}, attemptError{fmt.Errorf("commit inbox tx: %w", err)}
	}
	return v, nil
}
