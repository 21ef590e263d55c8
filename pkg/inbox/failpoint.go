package inbox

type crashPoint int

const (
	beforeCommit crashPoint = iota
	afterCommit
)

// crashed reports whether the consumer "dies" at p with m: the test hook
// says so, or Config.FailpointFunc returns an error. The caller then
// returns without settling the message.
func (c *Consumer) crashed(p crashPoint, m Message) bool {
	if c.crash != nil && c.crash(p, m) {
		return true
	}
	return c.failpointCrashed(p, m)
}

// failpointCrashed is the Config.FailpointFunc half of crashed.
func (c *Consumer) failpointCrashed(p crashPoint, m Message) bool {
	if c.cfg.FailpointFunc == nil {
		return false
	}
	name := FailpointBeforeCommit
	if p == afterCommit {
		name = FailpointAfterCommitBeforeAck
	}
	if err := c.cfg.FailpointFunc(name); err != nil {
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

// The failpoints of the inbox, passed to Config.FailpointFunc once per
// delivery that gets that far.
const (
	// FailpointBeforeCommit is hit after the handler ran, before the inbox
	// transaction commits.
	FailpointBeforeCommit = "inbox.before_commit"
	// FailpointAfterCommitBeforeAck is hit after the inbox transaction
	// committed, before the message is acked.
	FailpointAfterCommitBeforeAck = "inbox.after_commit_before_ack"
)
