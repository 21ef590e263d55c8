package inbox

import "time"

// Hooks are the consumer's observation and failure-injection points. Zero
// fields are no-ops.
type Hooks struct {
	// ObserveFunc, when set, is called with Config.Name and the time from a
	// worker taking a delivery to its commit. It is called from the workers
	// and must be safe for concurrent use and quick.
	ObserveFunc func(consumer string, d time.Duration)
	// FailpointFunc is failure injection, for tests and chaos runs: when
	// set, it is called at each of these points, once per delivery or per
	// batch that gets that far, and a non-nil error makes the consumer
	// behave as if the process died there (the transaction is rolled back
	// if it has not committed, the messages are neither acked nor nak'ed,
	// and JetStream redelivers them after AckWait):
	//
	//	"inbox.before_commit"            the handler ran, the transaction has not committed
	//	"inbox.after_commit_before_ack"  the transaction committed, the messages are not acked
	FailpointFunc func(name string) error
}

// observe calls Hooks.ObserveFunc, if any, with the time since start.
func (c *Consumer) observe(start time.Time) {
	if c.cfg.Hooks.ObserveFunc != nil {
		c.cfg.Hooks.ObserveFunc(c.cfg.Name, time.Since(start))
	}
}

// crashPoint is a place where Hooks.FailpointFunc may "kill" the consumer.
type crashPoint int

const (
	beforeCommit crashPoint = iota // "inbox.before_commit"
	afterCommit                    // "inbox.after_commit_before_ack"
)

// crashed reports whether the consumer "dies" at p with m: Hooks.FailpointFunc
// returns an error. The caller then returns without settling the message.
func (c *Consumer) crashed(p crashPoint, m Message) bool {
	if c.cfg.Hooks.FailpointFunc == nil {
		return false
	}
	name := "inbox.before_commit"
	if p == afterCommit {
		name = "inbox.after_commit_before_ack"
	}
	if err := c.cfg.Hooks.FailpointFunc(name); err != nil {
		c.log.Warn("inbox failpoint: abandoning the delivery as a crash would; JetStream redelivers it after AckWait",
			"event_id", m.EventID, "err", err)
		return true
	}
	return false
}

// crashedBatch is crashed for a batch: the process dies once for all of it,
// one hit of the failpoint.
func (c *Consumer) crashedBatch(p crashPoint, batch []*delivery) bool {
	return c.crashed(p, batch[0].m)
}
