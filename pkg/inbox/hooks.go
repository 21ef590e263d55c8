package inbox

import "time"

// Hooks are the consumer's observation and failure-injection points. Zero
// fields are no-ops.
type Hooks struct {
	// ObserveFunc gets Config.Name and the time from a worker taking a
	// delivery to its commit; called from the workers, it must be quick.
	ObserveFunc func(consumer string, d time.Duration)
	// FailpointFunc injects failures (tests, chaos runs): it is called at
	// these points, and an error makes the consumer act as if the process
	// died there (rolled back if not committed, nothing acked):
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
