// Package inbox consumes events from NATS JetStream so that each one takes
// effect exactly once, in order per aggregate: the consuming half of the
// transactional outbox (pkg/outbox is the producing half).
//
// # The pattern
//
// JetStream delivers at least once: a message is redelivered until it is
// acked. A [Consumer] turns that into "effectively once" with a Postgres
// transaction that does two things together for each event:
//
//  1. advances the consumer's cursor for the event's aggregate in
//     inbox_sequences from Aggregate-Seq-1 to Aggregate-Seq and inserts
//     (consumer, event id) into processed_events — the inbox — in one
//     statement that changes nothing unless the cursor stood just before
//     the event;
//  2. calls the [HandlerFunc] with that same transaction, so the business
//     effect (and any events it emits through its own outbox) commits
//     together with step 1, or not at all.
//
// An event whose type is not in Config.Handles skips step 2 and so needs no
// transaction of its own: alone, step 1 commits it by itself, in one round
// trip; in a batch (below), its step 1 goes with the others' in the batch's
// transaction.
//
// Only after the commit is the message acked. Messages are fetched from a
// durable pull consumer and spread over Config.Workers goroutines by a hash
// of (producer, aggregate id): one aggregate's events are handled one at a
// time, different aggregates in parallel.
//
// The handler always takes a batch: under load, the deliveries a worker
// already has waiting (up to Config.BatchSize, never waiting for more);
// otherwise a batch of one. One transaction applies them: steps 1 for all
// of them in one pipelined round trip, one call of the handler with the
// handled events in stream order, one commit, then the acks. In the same
// transaction, one more round trip finds out what the others are: copies
// are absorbed, early events parked (one round trip for all of them); a
// conflict is left to be dead-lettered on its own. A handler that fails,
// or an event that releases parked ones, rolls the batch back and the same
// handler gets the same deliveries one at a time, so a bad message is
// isolated exactly as without batches. A crash after a batch's commit,
// before its acks, brings the whole batch back, and every copy meets its
// processed_events row.
//
// So a handler that reads every row its batch needs at once, decides in
// memory in stream order and writes once pays two round trips a batch
// whatever its size (the inventory service reserves a batch of orders that
// way); [Each] adapts a handler that takes one event at a time.
//
// A batch holds its handler's locks until it commits. A handler that locks
// rows shared by many aggregates (stock per SKU) one event at a time, each
// in an order of its own, deadlocks with other workers' batches; each
// deadlock is a handler error, so the batch is redone one delivery at a
// time and nothing is lost, but throughput is. Lock all of the batch's
// shared rows in one statement, in one global order (the inventory service
// locks the stock rows of all the batch's orders in SKU order), and batches
// wait for each other in that order only, never in a cycle.
//
// # Traces
//
// With Config.TracerProvider set, each delivery the consumer applies is a
// consumer span "process <Event-Type>", a child of the span named by the
// message's traceparent, and the handler runs in it: the events it writes
// to its own outbox carry the trace on. In a batch each delivery still has
// its own span, a child of its own producer's, so every order's trace stays
// whole (docs/architecture.md, "Traces", says why not links).
//
// # Guarantees
//
//   - Crash before commit: the transaction rolls back and the message, not
//     acked, is redelivered after AckWait. A live process reports what it
//     holds in progress every AckWait/3, so a slow handler is never
//     redelivered while it runs.
//   - Crash after commit, before the ack, and every other copy of an event
//     (a relay's retry, a replay): it carries the same event id and meets
//     its processed_events row; it is acked without effect.
//   - Another event id at an applied sequence is a conflict: dead-lettered
//     ([ErrConflict]), counted and logged at ERROR, never dropped quietly.
//   - Order: an event beyond its aggregate's next sequence is parked and
//     acked, holding nothing in the broker, and applied, in order, by the
//     event that fills the gap. It is never dead-lettered for waiting.
//   - A failed handler (error, panic, failed commit) is rolled back and
//     retried with backoff; after MaxDeliver failures the message is a dead
//     letter. An outage of the database (unreachable, out of connections, a
//     deadlock or serialization failure) is retried without counting, so it
//     makes no dead letters. A message that does not decode ([Message]), or
//     whose handler returns [Poison], is a dead letter at once.
//   - A dead letter keeps subject, headers and payload; [RequeueDeadLetter]
//     sends it back through the same steps with its original event id. With
//     the sequence check on, it stops its aggregate (later events wait,
//     parked) and no other.
//   - The broker failing (a leader election, a partition, the durable
//     consumer or the stream deleted) does not end [Consumer.Run]: it
//     subscribes again with backoff, and [Consumer.State] tells how it
//     stands.
//   - Several processes may run consumers of one Config.Name: they share the
//     durable consumer, and the row lock on an aggregate's cursor makes them
//     take its events one at a time.
//
// # What the sequence check needs
//
// Aggregate-Seq numbers an aggregate's events per producer with no gaps, so
// the consumer must see every one: Config.FilterSubjects may select
// producers but never drop event types (Config.Handles names the types the
// handler needs; the others are only recorded). Config.SkipSequenceCheck
// turns the check off for consumers that need neither order nor gaps.
//
// processed_events rows are kept for Config.Retention, which must outlast
// every copy of an event that can still come; past it, the per-aggregate
// cursors, never deleted, still skip an old copy.
package inbox
