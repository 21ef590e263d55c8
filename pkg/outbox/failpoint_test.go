package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

var errInjected = errors.New("injected")

// failAt is a Hooks.FailpointFunc that fails the given hits (1-based) of
// the failpoint called name and lets everything else pass; it counts the
// hits of name.
type failAt struct {
	name string
	hits map[int64]bool
	n    atomic.Int64
}

func (f *failAt) hook(name string) error {
	if name != f.name {
		return nil
	}
	if f.hits[f.n.Add(1)] {
		return fmt.Errorf("failpoint %s: %w", name, errInjected)
	}
	return nil
}

func failOn(name string, hits ...int64) *failAt {
	f := &failAt{name: name, hits: map[int64]bool{}}
	for _, h := range hits {
		f.hits[h] = true
	}
	return f
}

// fastLease is a relay config whose leases expire quickly, so that a batch
// abandoned at a failpoint is taken over within the test.
func fastLease(fp *failAt) Config {
	return Config{
		LeaseDuration: 300 * time.Millisecond, PublishTimeout: 100 * time.Millisecond,
		PollInterval: 20 * time.Millisecond, BackoffBase: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond,
		Hooks: Hooks{FailpointFunc: fp.hook},
	}
}

func TestFailpointAfterClaim(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-2", "OrderCreated"))
	fp := failOn("outbox.after_claim", 1)
	r := e.relay(t, fastLease(fp))
	start(t, r)

	eventually(t, 10*time.Second, "both events published after the abandoned claim's lease expired", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 2, nil
	})
	if fp.n.Load() < 2 {
		t.Fatalf("failpoint hit %d times, want the failing claim and a later one", fp.n.Load())
	}
	if got := r.Counters(); got.TakenOver != 2 || got.Published != 2 {
		t.Fatalf("counters %+v: want both events taken over from the expired lease and published", got)
	}
	if got := streamMsgs(t, e.stream); got != 2 {
		t.Fatalf("stream holds %d messages, want 2", got)
	}
}

func TestFailpointBeforePublish(t *testing.T) { forEachMode(t, testFailpointBeforePublish) }

// In ModeCDC the stream "dies" and starts again from the slot's confirmed
// position, which is before all three.
func testFailpointBeforePublish(t *testing.T, mode Mode) {
	e := setup(t)
	var w Writer
	// The relay "dies" before handing the second event of its first batch
	// to the broker: the first may be stored, none is marked.
	fp := failOn("outbox.before_publish", 2)
	cfg := fastLease(fp)
	// One claim loop, so that the second hit is the second event of the
	// batch that holds all three: with two, the loops may split the events,
	// and the second hit be the first event of the other loop's batch, with
	// nothing stored before it.
	cfg.Workers = 1
	r := e.run(t, mode, cfg)
	add(t, e.db.Pool, &w, event("o-1", "A"), event("o-2", "A"), event("o-3", "A"))

	eventually(t, 10*time.Second, "all three published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 3, nil
	})
	if got := streamMsgs(t, e.stream); got != 3 {
		t.Fatalf("stream holds %d messages, want 3: the copy of the first event must be dropped", got)
	}
	if got := r.Counters(); got.Published != 3 || got.Duplicates != 1 {
		t.Fatalf("counters %+v: want 3 published, 1 duplicate ack (the first event's second copy)", got)
	}
}

func TestFailpointAfterAckBeforeMark(t *testing.T) { forEachMode(t, testFailpointAfterAckBeforeMark) }

// The crash between the PubAck and the record of it. In ModeCDC nothing
// was marked or confirmed: the next stream publishes the event again.
func testFailpointAfterAckBeforeMark(t *testing.T, mode Mode) {
	e := setup(t)
	var w Writer
	fp := failOn("outbox.after_ack_before_mark", 1)
	r := e.run(t, mode, fastLease(fp))
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"))

	eventually(t, 10*time.Second, "the event marked published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 1, nil
	})
	if fp.n.Load() != 2 {
		t.Fatalf("failpoint hit %d times, want 2 (the abandoned batch, the retry)", fp.n.Load())
	}
	wantTakenOver := int64(1) // the poller's lease passed to the retry
	if mode == ModeCDC {
		wantTakenOver = 0 // the stream has no leases
	}
	if got := r.Counters(); got.Published != 1 || got.Duplicates != 1 || got.TakenOver != wantTakenOver {
		t.Fatalf("counters %+v: want the retry to be acked as a duplicate and marked once", got)
	}
	if got := streamMsgs(t, e.stream); got != 1 {
		t.Fatalf("stream holds %d messages, want 1", got)
	}
	// A consumer of the stream sees the event once.
	cons, err := e.stream.OrderedConsumer(context.Background(), jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(10, jetstream.FetchMaxWait(500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for range batch.Messages() {
		n++
	}
	if n != 1 {
		t.Fatalf("a consumer received %d messages, want 1", n)
	}
}

func TestFailpointRetentionMidBatch(t *testing.T) {
	e := setup(t)
	var w Writer
	for i := range 5 {
		add(t, e.db.Pool, &w, event(fmt.Sprintf("old-%d", i), "A"))
	}
	add(t, e.db.Pool, &w, event("pending", "A"), event("dead", "A"), event("recent", "A"))
	ctx := context.Background()
	if _, err := e.db.Pool.Exec(ctx, `
		UPDATE outbox SET occurred_at = now() - interval '10 days',
		    published_at = CASE WHEN aggregate_id LIKE 'old-%' THEN now() - interval '10 days'
		                        WHEN aggregate_id = 'recent' THEN now() END,
		    dead_at = CASE WHEN aggregate_id = 'dead' THEN now() - interval '10 days' END`); err != nil {
		t.Fatal(err)
	}

	// The retention run "dies" after its first batch of two.
	fp := failOn("outbox.retention_mid_batch", 1)
	n, err := deleteExpired(ctx, e.db.Pool, 72*time.Hour, 2, fp.hook)
	if !errors.Is(err, errInjected) || n != 2 {
		t.Fatalf("first run: deleted %d, %v; want 2 and the injected error", n, err)
	}
	if got := count(t, e.db.Pool, "aggregate_id LIKE 'old-%'"); got != 3 {
		t.Fatalf("%d old rows left after the interrupted run, want 3", got)
	}
	// The next run deletes the rest, and only the rest.
	n, err = deleteExpired(ctx, e.db.Pool, 72*time.Hour, 2, fp.hook)
	if err != nil || n != 3 {
		t.Fatalf("next run: deleted %d, %v; want 3", n, err)
	}
	if fp.n.Load() != 2 {
		t.Fatalf("failpoint hit %d times, want 2 (once per run, after its first full batch)", fp.n.Load())
	}
	if count(t, e.db.Pool, "aggregate_id LIKE 'old-%'") != 0 ||
		count(t, e.db.Pool, "aggregate_id IN ('pending', 'dead', 'recent')") != 3 {
		t.Fatal("retention deleted the wrong rows")
	}
}
