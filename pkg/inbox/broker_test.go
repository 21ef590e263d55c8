package inbox

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// The broker's faults end no Consumer: each test below does to JetStream
// what an operator or an outage does, checks that Run is still running
// (run fails the test if Run returned an error by the end), and that
// events published afterwards are applied exactly once, in order.

func TestRecreatesADeletedDurableConsumer(t *testing.T) {
	t.Parallel()
	e := setup(t)
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)
	e.publish(t, newEvent("a", 1))
	eventually(t, "a/1 is applied", func() bool { return len(e.seqs(t, "a")) == 1 })

	// An operator deletes the durable consumer under the running shop.
	if err := e.js.DeleteConsumer(context.Background(), testStream, testConsumer); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the consumer subscribes again", func() bool { return c.Counters().Resubscribes >= 1 && c.State().Subscribed })
	e.publish(t, newEvent("a", 2), newEvent("b", 1))
	eventually(t, "later events are applied", func() bool {
		return len(e.seqs(t, "a")) == 2 && len(e.seqs(t, "b")) == 1 && e.settled(t)
	})
	// The recreated durable starts at the stream's beginning: a/1 comes
	// again and is absorbed.
	wantSeqs(t, e, "a", 1, 2)
	wantSeqs(t, e, "b", 1)
}

func TestWaitsForItsStream(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.Stream = "LATER"
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	// Not there yet, as when a consumer starts before the producer has
	// created its stream: Run keeps trying instead of returning.
	eventually(t, "the consumer reports itself down", func() bool { return !c.State().DownSince.IsZero() })
	e.nats.Stream(t, e.js, "LATER", "later.>")
	ev := newEvent("a", 1)
	m := ev.msg()
	m.Subject = "later.a.OrderCreated"
	e.publishMsg(t, m)
	eventually(t, "the event is applied once the stream exists", func() bool { return len(e.seqs(t, "a")) == 1 })
	if !c.State().Subscribed || !c.State().DownSince.IsZero() {
		t.Errorf("state %+v, want subscribed", c.State())
	}
}

func TestSurvivesJetStreamSwitchedOff(t *testing.T) {
	t.Parallel()
	e := setup(t)
	c := e.consumer(t, e.pool, e.js, e.config(t, record("")))
	run(t, c)
	e.publish(t, newEvent("a", 1))
	eventually(t, "a/1 is applied", func() bool { return len(e.seqs(t, "a")) == 1 })

	// Core NATS stays up, so the connection stays CONNECTED: only missed
	// heartbeats and failing API calls tell the consumer.
	e.nats.DisableJetStream()
	eventually(t, "the consumer notices", func() bool { return !c.State().Subscribed })
	e.nats.Restart() // JetStream comes back with the server
	eventually(t, "the consumer subscribes again", func() bool { return c.State().Subscribed })
	e.publish(t, newEvent("a", 2))
	eventually(t, "a/2 is applied", func() bool { return len(e.seqs(t, "a")) == 2 && e.settled(t) })
	wantSeqs(t, e, "a", 1, 2)
}

// A handler that runs several AckWaits is reported in progress and never
// redelivered meanwhile; the short AckWait only brings back the deliveries
// of a process that stopped reporting (see TestFailpointBeforeCommit).
func TestSlowHandlerIsNotRedelivered(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var calls atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, m Message) error {
		calls.Add(1)
		time.Sleep(3500 * time.Millisecond) // 3.5 × AckWait
		return record("")(ctx, tx, m)
	}
	cfg := e.config(t, h)
	cfg.AckWait = time.Second
	c := e.consumer(t, e.pool, e.js, cfg)
	run(t, c)
	e.publish(t, newEvent("a", 1))
	eventually(t, "the event is applied and acked", func() bool { return len(e.seqs(t, "a")) == 1 && e.settled(t) })
	cons, err := e.js.Consumer(context.Background(), testStream, testConsumer)
	if err != nil {
		t.Fatal(err)
	}
	info, err := cons.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.NumRedelivered != 0 || calls.Load() != 1 || c.Counters().Duplicates != 0 {
		t.Errorf("redelivered %d, handler called %d times, %d duplicates; want the one delivery only",
			info.NumRedelivered, calls.Load(), c.Counters().Duplicates)
	}
}
