package inbox

import (
	"sync/atomic"
	"time"
)

type counters struct {
	processed, duplicates, stale, conflicts, parked, retries, deadLetters, resubscribes, batches atomic.Int64
	lastDelivery, downSince                                                                      atomic.Int64 // unix nanoseconds; 0: never, not down
	subscribed                                                                                   atomic.Bool
}

// Counters are running totals of one Consumer instance, for metrics and
// tests. Several instances sharing a Name each count their own share.
type Counters struct {
	Processed    int64 // events applied and committed, requeued dead letters included
	Duplicates   int64 // copies absorbed without effect: this event id was already processed
	Stale        int64 // new ids at a passed sequence whose record is gone (older than Retention), skipped
	Conflicts    int64 // events at a sequence where another event was applied, dead-lettered as conflicts
	Parked       int64 // early events parked in inbox_parked (and acked) until the gap before them is filled
	Retries      int64 // failed deliveries handed back to JetStream for another attempt after a backoff
	DeadLetters  int64 // events dead-lettered, by their last delivery or by a requeue that failed again
	Resubscribes int64 // subscriptions that JetStream ended or lost (missed heartbeats, consumer deleted, …), each followed by a new one
	Batches      int64 // transactions that applied several deliveries at once (see Config.BatchSize)
}

// Counters returns the consumer's running totals.
func (c *Consumer) Counters() Counters {
	return Counters{
		Processed: c.stats.processed.Load(), Duplicates: c.stats.duplicates.Load(), Stale: c.stats.stale.Load(),
		Conflicts: c.stats.conflicts.Load(), Parked: c.stats.parked.Load(),
		Retries: c.stats.retries.Load(), DeadLetters: c.stats.deadLetters.Load(),
		Resubscribes: c.stats.resubscribes.Load(), Batches: c.stats.batches.Load(),
	}
}

// State is how one Consumer instance stands with JetStream now.
type State struct {
	Subscribed   bool      // pulling from JetStream
	DownSince    time.Time // while not subscribed after having been (or failing from the start): since when; zero otherwise
	LastDelivery time.Time // when JetStream last delivered a message to this instance; zero before the first
}

// State returns the consumer's state, for readiness reports and metrics.
func (c *Consumer) State() State {
	return State{Subscribed: c.stats.subscribed.Load(), DownSince: unixNano(c.stats.downSince.Load()),
		LastDelivery: unixNano(c.stats.lastDelivery.Load())}
}

func unixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}
