package inbox

import "time"

// Hooks are the consumer's observation and failure-injection points, not
// settings: what it does is the same with or without them. Zero fields are
// no-ops.
type Hooks struct {
	// ObserveFunc, when set, is called with Config.Name and the processing
	// time of every delivery that committed (applied or absorbed as a
	// duplicate): from a worker taking it to the commit. It is called from
	// the workers and must be safe for concurrent use and quick.
	ObserveFunc func(consumer string, d time.Duration)
	// FailpointFunc, when set, is called with the name of each failpoint a
	// delivery passes (FailpointBeforeCommit, FailpointAfterCommitBeforeAck;
	// a batch passes each once). A non-nil error makes the consumer behave
	// as if the process died there: the transaction is rolled back if it
	// has not committed, and the messages are neither acked nor nak'ed, so
	// JetStream redelivers them after AckWait. The shop sets it to
	// internal/failpoint.Inject.
	FailpointFunc func(name string) error
}

// observe calls Hooks.ObserveFunc, if any, with the time since start.
func (c *Consumer) observe(start time.Time) {
	if c.cfg.Hooks.ObserveFunc != nil {
		c.cfg.Hooks.ObserveFunc(c.cfg.Name, time.Since(start))
	}
}

type crashPoint int

const (
	beforeCommit crashPoint = iota
	afterCommit
)

// crashed reports whether the consumer "dies" at p with m: the test hook
// says so, or Hooks.FailpointFunc returns an error. The caller then
// returns without settling the message.
func (c *Consumer) crashed(p crashPoint, m Message) bool {
	if c.crash != nil && c.crash(p, m) {
		return true
	}
	return c.failpointCrashed(p, m)
}

// failpointCrashed is the Hooks.FailpointFunc half of crashed.
func (c *Consumer) failpointCrashed(p crashPoint, m Message) bool {
	if c.cfg.Hooks.FailpointFunc == nil {
		return false
	}
	name := FailpointBeforeCommit
	if p == afterCommit {
		name = FailpointAfterCommitBeforeAck
	}
	if err := c.cfg.Hooks.FailpointFunc(name); err != nil {
		c.log.Warn("inbox failpoint: abandoning the delivery as a crash would; JetStream redelivers it after AckWait",
			"event_id", m.EventID, "err", err)
		return true
	}
	return false
}

// crashedBatch is crashed for a batch: the process dies once for all of it
// (one failpoint hit), or where the test hook says it dies for any of its
// events.
func (c *Consumer) crashedBatch(p crashPoint, batch []*delivery) bool {
	if c.crash != nil {
		for _, d := range batch {
			if c.crash(p, d.m) {
				return true
			}
		}
	}
	return c.failpointCrashed(p, batch[0].m)
}

// The failpoints of the inbox, passed to Hooks.FailpointFunc once per
// delivery that gets that far.
const (
	// FailpointBeforeCommit is hit after the handler ran, before the inbox
	// transaction commits.
	FailpointBeforeCommit = "inbox.before_commit"
	// FailpointAfterCommitBeforeAck is hit after the inbox transaction
	// committed, before the message is acked.
	FailpointAfterCommitBeforeAck = "inbox.after_commit_before_ack"
)
