package inbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Early messages are parked and acked: they hold none of the durable
// consumer's ack-pending capacity, which every aggregate shares. With the
// capacity at 64 and 500 early messages of other aggregates ahead of it in
// the stream, a fresh aggregate is still applied; before parking, the
// early messages filled the capacity and stopped every delivery.
func TestEarlyMessagesHoldNoCapacity(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.MaxAckPending = 64
	cfg.BatchSize = 4 // a prefetch of 16 per worker's queue fits the small capacity
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	for i := range 500 {
		e.publish(t, newEvent(fmt.Sprint("early-", i), 2)) // seq 1 never comes
	}
	e.publish(t, newEvent("fresh", 1), newEvent("fresh", 2), newEvent("fresh", 3))
	eventually(t, "the fresh aggregate is applied", func() bool { return len(e.seqs(t, "fresh")) == 3 })
	eventually(t, "every early message is parked and acked", func() bool {
		n, _, err := ParkedStats(context.Background(), e.db.Pool, testConsumer)
		return err == nil && n == 500 && e.settled(t)
	})
	wantSeqs(t, e, "fresh", 1, 2, 3)
	if got := c.Counters(); got.Parked != 500 || got.Processed != 3 {
		t.Errorf("counters %+v, want 500 parked and 3 processed", got)
	}
}

// The event that fills the gap applies the parked ones in order, in its own
// transaction.
func TestParkedEventsApplyInOrderWhenTheGapFills(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var order []int64
	var mu sync.Mutex
	c := e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		mu.Lock()
		order = append(order, m.Seq)
		mu.Unlock()
		return record("")(ctx, tx, m)
	}))
	run(t, c)
	e.publish(t, newEvent("a", 3), newEvent("a", 2))
	eventually(t, "a/3 and a/2 are parked", func() bool { return c.Counters().Parked == 2 && e.settled(t) })
	wantSeqs(t, e, "a")
	e.publish(t, newEvent("a", 1))
	eventually(t, "all three are applied", func() bool { return len(e.seqs(t, "a")) == 3 })
	wantSeqs(t, e, "a", 1, 2, 3)
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(order, []int64{1, 2, 3}) {
		t.Errorf("handler saw seqs %v, want [1 2 3]", order)
	}
	// The counters move after the commit that made the effects visible.
	eventually(t, "the three are counted", func() bool { return c.Counters().Processed == 3 })
	if n, _, _ := ParkedStats(context.Background(), e.db.Pool, testConsumer); n != 0 {
		t.Errorf("%d still parked, want none", n)
	}
}

// An event no handler wants fills the gap in one statement of its own; what
// is parked behind it is applied all the same.
func TestUnhandledEventFillingTheGapReleasesTheParked(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.Handles = []string{"OrderCreated"}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	e.publish(t, newEvent("a", 2))
	eventually(t, "a/2 is parked", func() bool { return c.Counters().Parked == 1 })
	first := newEvent("a", 1)
	first.typ = "OrderNoted" // not handled
	e.publish(t, first)
	eventually(t, "a/2 is applied", func() bool { return len(e.seqs(t, "a")) == 1 })
	wantSeqs(t, e, "a", 2)
}

// A parked event whose handler fails does not take the event that filled
// the gap down with it: that one commits, and the sweeper retries the parked
// one with backoff until it succeeds.
func TestFailingParkedEventIsRetriedBySweeper(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var failures atomic.Int32
	c := e.consumer(t, e.pool, e.js, e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
		if m.Seq == 2 && failures.Add(1) <= 2 {
			return errors.New("not yet")
		}
		return record("")(ctx, tx, m)
	}))
	run(t, c)
	e.publish(t, newEvent("a", 2))
	eventually(t, "a/2 is parked", func() bool { return c.Counters().Parked == 1 })
	e.publish(t, newEvent("a", 1))
	eventually(t, "a/1 and then a/2 are applied", func() bool { return len(e.seqs(t, "a")) == 2 })
	wantSeqs(t, e, "a", 1, 2)
	if got := c.Counters(); got.Retries < 1 || got.DeadLetters != 0 {
		t.Errorf("counters %+v, want a retry and no dead letter", got)
	}
}

// Only the same event id is a duplicate. Another event at an applied
// sequence — here an event of a type the consumer does not handle took
// sequence 2, and the real one comes after it — is a conflict: dead-lettered
// as such, naming both ids, never counted as a duplicate.
func TestConflictIsDeadLetteredNotDropped(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.Handles = []string{"OrderCreated", "OrderPaid"}
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	forged := newEvent("a", 2)
	forged.typ = "SomethingElse"
	real := newEvent("a", 2)
	real.typ = "OrderPaid"
	e.publish(t, newEvent("a", 1), forged, real)
	eventually(t, "the real event is a dead letter", func() bool { return c.Counters().Conflicts == 1 && e.settled(t) })
	dead, err := ListDeadLetters(context.Background(), e.db.Pool, testConsumer, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].EventID != real.id || dead[0].ConflictWith == nil || *dead[0].ConflictWith != forged.id {
		t.Fatalf("dead letters %+v, want the real event, conflicting with the forged one", dead)
	}
	if got := c.Counters(); got.Duplicates != 0 || got.Stale != 0 {
		t.Errorf("counters %+v: a conflict must not count as a duplicate", got)
	}
	// A requeue cannot make it apply: it stays a dead letter until an
	// operator decides.
	if err := RequeueDeadLetter(context.Background(), e.db.Pool, dead[0].ID); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the requeue failed again", func() bool {
		return e.count(t, `SELECT count(*) FROM dead_letters WHERE requeued_at IS NULL AND resolved_at IS NULL`) == 1
	})
	if got := c.Counters().DeadLetters; got != 1 {
		t.Errorf("dead letters counted %d times, want 1: a failed requeue adds none", got)
	}
}

// Two different early events at one sequence: the second is a conflict too.
func TestConflictWhileParked(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// The stream is updated before the consumer starts: nats-server
	// v2.15.3 races (under -race) between a stream update and a durable
	// being created on it.
	shortDuplicateWindow(t, e)
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)
	one, two := newEvent("a", 3), newEvent("a", 3)
	e.publish(t, one, two)
	e.republish(t, one) // and a copy of the first
	eventually(t, "one parked, one conflict, one duplicate", func() bool {
		got := c.Counters()
		return got.Parked == 1 && got.Conflicts == 1 && got.Duplicates == 1 && e.settled(t)
	})
}

// An operator drops a parked event with a reason; the row stays for audit,
// and a real event that comes later at the same sequence takes its place.
func TestDiscardParked(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)
	bogus := newEvent("a", 2)
	e.publish(t, bogus)
	eventually(t, "parked", func() bool { return c.Counters().Parked == 1 })
	list, err := ListParked(ctx, e.db.Pool, testConsumer, 10)
	if err != nil || len(list) != 1 || list[0].EventID != bogus.id || list[0].WaitsFor != 1 {
		t.Fatalf("ListParked = %+v, %v; want the bogus event, waiting for seq 1", list, err)
	}
	if err := DiscardParked(ctx, e.db.Pool, testConsumer, bogus.id, ""); err == nil {
		t.Fatal("a discard without a reason was accepted")
	}
	if err := DiscardParked(ctx, e.db.Pool, testConsumer, bogus.id, "forged by a test"); err != nil {
		t.Fatal(err)
	}
	if err := DiscardParked(ctx, e.db.Pool, testConsumer, uuid.New(), "no such"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("discard of an unknown event: %v, want ErrNotFound", err)
	}
	if n, _, _ := ParkedStats(ctx, e.db.Pool, testConsumer); n != 0 {
		t.Fatalf("%d open parked events after the discard, want 0", n)
	}
	if n := e.count(t, `SELECT count(*) FROM inbox_parked WHERE discard_reason = 'forged by a test'`); n != 1 {
		t.Fatalf("%d discarded rows kept, want 1", n)
	}
	real := newEvent("a", 2)
	e.publish(t, real, newEvent("a", 1))
	eventually(t, "a/1 and the real a/2 are applied", func() bool { return len(e.seqs(t, "a")) == 2 })
	var got uuid.UUID
	if err := e.db.Pool.QueryRow(ctx, `SELECT event_id FROM effects WHERE aggregate_id = 'a' AND seq = 2`).Scan(&got); err != nil || got != real.id {
		t.Fatalf("a/2 applied as %s (%v), want the real event %s", got, err, real.id)
	}
}

// A new id at a passed sequence whose record is gone (older than the
// inbox's retention) cannot be told from a conflict: it is skipped as
// stale, counted apart from duplicates.
func TestStaleIsNotADuplicate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)
	e.publish(t, newEvent("a", 1))
	eventually(t, "a/1 is applied", func() bool { return len(e.seqs(t, "a")) == 1 })
	if _, err := e.db.Pool.Exec(context.Background(), `DELETE FROM processed_events`); err != nil {
		t.Fatal(err) // as retention would, days later
	}
	e.publish(t, newEvent("a", 1))
	eventually(t, "the replay is skipped", func() bool { return c.Counters().Stale == 1 && e.settled(t) })
	if got := c.Counters(); got.Duplicates != 0 || got.Conflicts != 0 {
		t.Errorf("counters %+v, want the replay counted as stale only", got)
	}
	wantSeqs(t, e, "a", 1)
}

// A dead letter discarded with a reason is resolved (nothing counts it any
// more), keeps its row, and is never applied.
func TestDiscardDeadLetter(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	c := e.consumer(t, e.pool, e.js, e.config(t, func(context.Context, pgx.Tx, Message) error {
		return Poison(errors.New("garbage"))
	}))
	run(t, c)
	e.publish(t, newEvent("a", 1))
	var dead []DeadLetter
	eventually(t, "a dead letter", func() bool {
		dead, _ = ListDeadLetters(ctx, e.db.Pool, testConsumer, 10)
		return len(dead) == 1
	})
	if err := DiscardDeadLetter(ctx, e.db.Pool, dead[0].ID, ""); err == nil {
		t.Fatal("a discard without a reason was accepted")
	}
	if err := DiscardDeadLetter(ctx, e.db.Pool, dead[0].ID, "garbage from a test"); err != nil {
		t.Fatal(err)
	}
	if err := DiscardDeadLetter(ctx, e.db.Pool, dead[0].ID, "again"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a second discard: %v, want ErrNotFound", err)
	}
	if open, _ := ListDeadLetters(ctx, e.db.Pool, testConsumer, 10); len(open) != 0 {
		t.Fatalf("%d open dead letters after the discard", len(open))
	}
	if n := e.count(t, `SELECT count(*) FROM dead_letters WHERE discard_reason = 'garbage from a test' AND resolved_at IS NOT NULL`); n != 1 {
		t.Fatalf("%d discarded rows kept, want 1", n)
	}
	if err := RequeueDeadLetter(ctx, e.db.Pool, dead[0].ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("requeue of a discarded dead letter: %v, want ErrNotFound", err)
	}
	wantSeqs(t, e, "a")
}
