package inbox

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"
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
