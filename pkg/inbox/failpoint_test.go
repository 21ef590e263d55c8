package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/outbox"
)

var errInjected = errors.New("injected")

// failFirst is a FailpointFunc that fails the first hit of name only.
func failFirst(name string, hits *atomic.Int32) func(string) error {
	return func(n string) error {
		if n != name {
			return nil
		}
		if hits.Add(1) == 1 {
			return fmt.Errorf("failpoint %s: %w", n, errInjected)
		}
		return nil
	}
}

func TestFailpointBeforeCommit(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.AckWait = time.Second // the redelivery comes after AckWait
	var hits atomic.Int32
	cfg.Hooks.FailpointFunc = failFirst("inbox.before_commit", &hits)
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)

	e.publish(t, newEvent("a", 1), newEvent("a", 2))
	// a/1 "crashes" before its commit; a/2 is parked meanwhile; a/1's
	// redelivery commits with a/2 in one transaction: two hits.
	eventually(t, "both events are applied and acked", func() bool {
		return hits.Load() >= 2 && len(e.seqs(t, "a")) == 2 && e.settled(t)
	})

	wantSeqs(t, e, "a", 1, 2)
	if got := c.Counters(); got.Processed != 2 || got.Duplicates != 0 {
		t.Fatalf("counters %+v: want 2 processed; the rolled-back attempt left nothing to absorb", got)
	}
}

func TestFailpointAfterCommitBeforeAck(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.AckWait = time.Second
	var hits atomic.Int32
	cfg.Hooks.FailpointFunc = failFirst("inbox.after_commit_before_ack", &hits)
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)

	e.publish(t, newEvent("a", 1))
	eventually(t, "the redelivered copy is acked", func() bool { return hits.Load() >= 2 && e.settled(t) })

	wantSeqs(t, e, "a", 1)
	// The first delivery "died" before its counters; the redelivery is
	// counted as the duplicate it is.
	if got := c.Counters(); got.Duplicates != 1 {
		t.Fatalf("counters %+v: want the redelivery absorbed as a duplicate", got)
	}
}

// TestRelayAfterAckBeforeMarkAppliedOnce runs the outbox relay into this
// consumer. The relay "dies" after the broker acked an event and before
// marking it; the stream's duplicate window is shorter than the lease, so
// the relay's second publish is stored as a second message. The inbox
// applies the event once.
func TestRelayAfterAckBeforeMarkAppliedOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	shortDuplicateWindow(t, e)
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)

	var hits atomic.Int32
	relay, err := outbox.NewRelay(e.db.Pool, e.js, outbox.Config{
		LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		PollInterval: 20 * time.Millisecond, BackoffBase: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond,
		Hooks:  outbox.Hooks{FailpointFunc: failFirst("outbox.after_ack_before_mark", &hits)},
		Logger: e.config(t, nil).Logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	})

	var w outbox.Writer
	if err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
		return w.Add(context.Background(), tx, outbox.Event{
			AggregateType: "order", AggregateID: "a", Type: "OrderCreated",
			Subject: "orders.a.OrderCreated", Payload: map[string]string{"order_id": "a"},
		})
	}); err != nil {
		t.Fatal(err)
	}

	eventually(t, "the relay marks the event after its retry", func() bool {
		return e.count(t, `SELECT count(*) FROM outbox WHERE published_at IS NOT NULL`) == 1
	})
	eventually(t, "every copy is acked", func() bool { return e.settled(t) })
	wantSeqs(t, e, "a", 1)
	st, err := e.js.Stream(context.Background(), testStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if hits.Load() != 2 || info.State.Msgs != 2 {
		t.Fatalf("failpoint hit %d times, stream holds %d messages; want 2 and 2 (the copy stored)", hits.Load(), info.State.Msgs)
	}
	if got := c.Counters(); got.Processed != 1 || got.Duplicates != 1 {
		t.Fatalf("counters %+v: want the effect once and the copy absorbed", got)
	}
}
