// Package outbox is a transactional outbox for Postgres and NATS JetStream:
// a business change and the events that describe it commit in one local
// transaction, and a relay publishes the committed events afterwards.
//
// # Writing
//
// [Writer.Add] inserts events inside the caller's pgx.Tx, and [Writer.Queue]
// queues the same statements on a pgx.Batch the caller sends on its
// transaction. Either way the events commit or roll back with the business
// rows: a committed change always has its events, a rolled-back one never
// does. Each event gets a UUIDv7 id, the Nats-Msg-Id of every copy ever
// published, and the next number of its aggregate's sequence, with no gaps.
// The trace context of ctx goes into the event's headers in the same
// transaction, so the consumer continues the writer's trace however late
// the event is published.
//
// # Relaying
//
// A [Relay] claims a batch of due events (each the oldest unpublished event
// of its aggregate, so k+1 is never sent before k is acked) under a lease
// committed on the rows, publishes it with no database lock held, waits for
// the PubAcks and marks the acked events published, fenced by the claim's
// token. Several relays run side by side. LISTEN/NOTIFY wakes them when
// events commit; polling is the fallback. An event that fails on its own
// (too large, invalid headers, or MaxAttempts failures) becomes dead: kept,
// counted by [ReadStats], listed by [ListDead], put back by [Requeue].
// Published events older than Retention are deleted; pending and dead ones
// never are.
//
// In [ModeCDC] the relay does not claim: it streams the outbox's inserts
// from a logical replication slot, in commit order, publishes them the
// same way, marks them published, and confirms a position to the slot only
// when every event at or before it is acked and marked. What the stream
// cannot publish in order it leaves to the table, where a poller publishes
// it as above. The guarantees below hold in both modes.
//
// # Guarantees
//
//   - Crash after the business commit: the event is a committed row, and a
//     relay publishes it whenever one runs.
//   - Relay crash after claiming: its claims are free within seconds (a live
//     relay renews a row of its own every second), or when the lease ends.
//   - Broker timeout, lost connection, crash after the PubAck: the event is
//     published again with the same id; the stream's duplicate window, or
//     the consumer's inbox (pkg/inbox), drops the copy. Duplicates, never
//     loss.
//   - A stale relay, paused past its lease, marks nothing: the token changed.
//     (ModeCDC: one relay streams a slot at a time; a crash between the
//     PubAck and the slot's confirmation streams the events again.)
//   - Broker outage or a missing stream: not the events' failure. The relay
//     counts no attempt, pauses and publishes again when the broker takes
//     events; no event dies of an outage.
//   - A poison event holds back only the later events of its own aggregate.
//
// Delivery is at least once, in order per aggregate. [Config.RetryHorizon]
// bounds how late a copy can come while the broker works; consumers must
// remember event ids longer. One loss the relay cannot see: the broker
// acknowledges an event and loses it later (a crash before its fsync, a
// message deleted by hand). Finding those takes the stream; [RepublishAll]
// sends them again, same ids, in order.
//
// docs/architecture.md tells how the relay does it, and why it claims per
// row rather than owning shards.
package outbox
