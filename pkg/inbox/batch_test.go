package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// backlog publishes n events over aggregates (each aggregate's in order)
// before any consumer runs, so that workers find batches waiting.
func backlog(t *testing.T, e *env, aggregates, perAggregate int) {
	t.Helper()
	for seq := 1; seq <= perAggregate; seq++ {
		for a := range aggregates {
			e.publish(t, newEvent(fmt.Sprint("b-", a), int64(seq)))
		}
	}
}

func TestBatchesApplyManyDeliveriesInOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	backlog(t, e, 20, 10)
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)
	eventually(t, "every event is applied", func() bool { return e.count(t, `SELECT count(*) FROM effects`) == 200 })
	for a := range 20 {
		wantSeqs(t, e, fmt.Sprint("b-", a), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
	}
	got := c.Counters()
	if got.Processed != 200 || got.Batches == 0 || got.Duplicates != 0 {
		t.Errorf("counters %+v, want 200 processed in some batches, no duplicates", got)
	}
}

// One poison message in a batch rolls the batch back; the worker retries it
// one delivery at a time, so only that message becomes a dead letter.
func TestPoisonInABatchIsIsolated(t *testing.T) {
	t.Parallel()
	e := setup(t)
	backlog(t, e, 10, 5)
	c := e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		if m.AggregateID == "b-3" && m.Seq == 2 {
			return Poison(errors.New("cannot apply this one"))
		}
		return record("")(ctx, tx, m)
	}))
	run(t, c)
	// b-3 stops at its dead seq 2 (3..5 park behind it); the rest apply.
	eventually(t, "the others are applied", func() bool { return e.count(t, `SELECT count(*) FROM effects`) == 9*5+1 })
	eventually(t, "settled", func() bool { return e.settled(t) })
	dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10)
	if err != nil || len(dead) != 1 || dead[0].Header.Get("Aggregate-Id") != "b-3" || dead[0].Header.Get("Aggregate-Seq") != "2" {
		t.Fatalf("dead letters %+v, %v; want b-3/2 alone", dead, err)
	}
	wantSeqs(t, e, "b-3", 1)
}

// A crash after the commit of a batch of several deliveries, before the
// acks: every redelivered copy is absorbed by its processed_events row, not
// handed to the handler again.
func TestCrashAfterBatchCommitIsAbsorbed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	backlog(t, e, 10, 5)
	cfg := e.config(t, record(""))
	cfg.AckWait = time.Second // the redelivery comes after AckWait
	// One worker: the commit that follows the handler's call is that
	// batch's, and the failpoint crashes the first batch of several.
	cfg.Workers = 1
	var viaBatch atomic.Bool // the transaction in progress applies several deliveries
	cfg.Handler = func(ctx context.Context, tx pgx.Tx, batch []Batched) error {
		for _, b := range batch {
			if err := record("")(b.Ctx, tx, b.Message); err != nil {
				return err
			}
		}
		viaBatch.Store(len(batch) > 1)
		return nil
	}
	var crashes atomic.Int32
	cfg.Hooks.FailpointFunc = func(name string) error {
		if name == "inbox.after_commit_before_ack" && viaBatch.Swap(false) && crashes.Add(1) == 1 {
			return errInjected
		}
		return nil
	}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	eventually(t, "everything applied and settled", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 50 && e.settled(t)
	})
	if n := e.count(t, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d events applied twice", n)
	}
	if crashes.Load() == 0 {
		t.Fatal("no batch's commit crashed; the test proves nothing")
	}
	if got := c.Counters(); got.Duplicates < 1 {
		t.Errorf("counters %+v, want the crashed commit's deliveries absorbed as duplicates", got)
	}
}

// A batch settles what is not new in the same transaction: copies are
// absorbed, early events parked; a conflict is left to be dead-lettered on
// its own. The events around them are applied as usual.
func TestBatchSettlesCopiesEarlyEventsAndConflicts(t *testing.T) {
	t.Parallel()
	e := setup(t)
	shortDuplicateWindow(t, e)
	first := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	x1 := newEvent("x", 1)
	e.publish(t, x1)
	eventually(t, "x/1 applied", func() bool { return len(e.seqs(t, "x")) == 1 && e.settled(t) })
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// With no consumer running, a backlog: new events, a copy, an early
	// event, a conflicting one.
	e.publish(t, newEvent("a", 1), newEvent("a", 2))
	e.republish(t, x1)
	e.publish(t, newEvent("b", 3), newEvent("x", 1), newEvent("a", 3))
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)
	eventually(t, "everything settled", func() bool { return e.settled(t) && len(e.seqs(t, "a")) == 3 })
	wantSeqs(t, e, "a", 1, 2, 3)
	wantSeqs(t, e, "x", 1)
	got := c.Counters()
	// Whether the worker found them batched or one by one, the outcome is
	// the same (TestBatchesApplyManyDeliveriesInOrder makes sure batches
	// happen).
	if got.Processed != 3 || got.Duplicates != 1 || got.Parked != 1 || got.Conflicts != 1 {
		t.Errorf("counters %+v, want 3 processed, 1 duplicate, 1 parked, 1 conflict", got)
	}
}

// Batches of different workers that lock shared rows in opposite orders
// deadlock (an even aggregate's event locks row 0, an odd one's row 1, so
// a batch that starts with an even aggregate and one that starts with an
// odd one wait for each other); Postgres aborts one, the worker redoes
// that batch one delivery at a time, and every event still takes effect
// exactly once, none dead-lettered.
func TestBatchesThatDeadlockLoseNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if _, err := e.db.Pool.Exec(context.Background(),
		`CREATE TABLE hot (k int PRIMARY KEY, n int NOT NULL); INSERT INTO hot VALUES (0, 0), (1, 0)`); err != nil {
		t.Fatal(err)
	}
	const aggregates, perAggregate = 20, 10
	backlog(t, e, aggregates, perAggregate)
	apply := record("")
	c := e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		var a int
		if _, err := fmt.Sscanf(m.AggregateID, "b-%d", &a); err != nil {
			return Poison(err)
		}
		if _, err := tx.Exec(ctx, `UPDATE hot SET n = n + 1 WHERE k = $1`, a%2); err != nil {
			return err
		}
		time.Sleep(time.Millisecond) // hold the lock a moment, as a real handler's next statements would
		return apply(ctx, tx, m)
	}))
	run(t, c)
	eventually(t, "every event is applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == aggregates*perAggregate
	})
	eventually(t, "settled", func() bool { return e.settled(t) })
	if n := e.count(t, `SELECT sum(n) FROM hot`); n != aggregates*perAggregate {
		t.Fatalf("the hot rows count %d updates, want %d: an effect was lost or applied twice", n, aggregates*perAggregate)
	}
	if dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10); err != nil || len(dead) != 0 {
		t.Fatalf("dead letters %+v, %v; want none", dead, err)
	}
	for a := range aggregates {
		wantSeqs(t, e, fmt.Sprint("b-", a), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
	}
}

// Deliveries of types the consumer does not handle cost no transaction of
// their own in a batch: their record statements ride in the batch's
// transaction. Counted by the distinct xmin (the writing transaction) of
// the processed_events rows: far fewer transactions than filtered events.
func TestFilteredDeliveriesRideInTheBatch(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const aggregates, perAggregate = 20, 10
	for seq := 1; seq <= perAggregate; seq++ {
		for a := range aggregates {
			ev := newEvent(fmt.Sprint("f-", a), int64(seq))
			if seq%2 == 0 {
				ev.typ = "OrderAwaitingPayment" // not handled
			}
			e.publish(t, ev)
		}
	}
	cfg := e.config(t, record(""))
	cfg.Handles = []string{"OrderCreated"}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	eventually(t, "every event is recorded", func() bool {
		return e.count(t, `SELECT count(*) FROM processed_events WHERE consumer_name = $1`, testConsumer) == aggregates*perAggregate
	})
	for a := range aggregates {
		wantSeqs(t, e, fmt.Sprint("f-", a), 1, 3, 5, 7, 9)
	}
	const filtered = aggregates * perAggregate / 2
	txs := e.count(t, `SELECT count(DISTINCT xmin::text) FROM processed_events WHERE consumer_name = $1`, testConsumer)
	if got := c.Counters(); got.Batches == 0 || txs >= filtered {
		t.Errorf("%d transactions recorded %d events (%d of them filtered) in %d batches; want batches, and fewer transactions than filtered events",
			txs, aggregates*perAggregate, filtered, got.Batches)
	}
}

// The handler takes a batch's events in one call, in stream order, each
// with a context of its own.
func TestHandlerTakesTheBatchInOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	backlog(t, e, 20, 10)
	cfg := e.config(t, record(""))
	var calls, widest atomic.Int32
	cfg.Handler = func(ctx context.Context, tx pgx.Tx, batch []Batched) error {
		calls.Add(1)
		if n := int32(len(batch)); n > widest.Load() {
			widest.Store(n) // one batch at a time per worker is enough for a maximum here
		}
		for _, b := range batch {
			if b.Ctx == nil {
				return errors.New("an event without its context")
			}
			if err := record("")(b.Ctx, tx, b.Message); err != nil {
				return err
			}
		}
		return nil
	}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	eventually(t, "every event is applied", func() bool { return e.count(t, `SELECT count(*) FROM effects`) == 200 })
	for a := range 20 {
		wantSeqs(t, e, fmt.Sprint("b-", a), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
	}
	if got := c.Counters(); got.Processed != 200 || got.Duplicates != 0 || got.Retries != 0 {
		t.Errorf("counters %+v, want 200 processed, no duplicates, no retries", got)
	}
	if calls.Load() == 0 || widest.Load() < 2 {
		t.Errorf("the handler was called %d times, with at most %d events; want batches", calls.Load(), widest.Load())
	}
}

// A batch that fails (here the handler panics on every batch of several)
// is rolled back, and the same handler then applies the same deliveries one
// at a time: a poison event among them is dead-lettered alone, the rest are
// applied once.
func TestAFailingBatchIsAppliedOneDeliveryAtATime(t *testing.T) {
	t.Parallel()
	e := setup(t)
	backlog(t, e, 10, 5)
	cfg := e.config(t, record(""))
	var batches atomic.Int32
	cfg.Handler = func(ctx context.Context, tx pgx.Tx, batch []Batched) error {
		if len(batch) > 1 {
			batches.Add(1)
			if err := record("")(ctx, tx, batch[0].Message); err != nil { // rolled back with the panic
				return err
			}
			panic("handler bug on batches")
		}
		m := batch[0].Message
		if m.AggregateID == "b-3" && m.Seq == 2 {
			return Poison(errors.New("cannot apply this one"))
		}
		return record("")(batch[0].Ctx, tx, m)
	}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	eventually(t, "the others are applied", func() bool { return e.count(t, `SELECT count(*) FROM effects`) == 9*5+1 })
	eventually(t, "settled", func() bool { return e.settled(t) })
	dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10)
	if err != nil || len(dead) != 1 || dead[0].Header.Get("Aggregate-Id") != "b-3" || dead[0].Header.Get("Aggregate-Seq") != "2" {
		t.Fatalf("dead letters %+v, %v; want b-3/2 alone", dead, err)
	}
	if n := e.count(t, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d events applied twice", n)
	}
	if batches.Load() == 0 {
		t.Error("the handler never got a batch of several; the test proves nothing")
	}
}
