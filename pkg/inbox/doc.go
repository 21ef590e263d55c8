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
// With Config.TracerProvider set, every delivery the consumer applies is a
// span of kind consumer, "process <Event-Type>", whose parent is the span
// named by the message's traceparent: the relay's publish span when the
// producer's relay has a tracer provider, else the producer's own span,
// written by pkg/outbox in its transaction. The handler runs with that span in its ctx, so
// the events it writes to its own outbox carry it on: one order is one
// trace from the HTTP request that created it through every service.
//
// A child, not a link. A link is what OpenTelemetry suggests when one
// operation handles many messages, and a batch transaction is one: but a
// span with links starts a trace of its own, and the events its handlers
// write would leave their orders' traces for the batch's. A reader looking
// for one order in Jaeger would find its journey cut in two at every
// batched hop, depending on load. So a batch gives each delivery its own
// span, a child of its own producer, all of them over the one transaction
// they share (same start, same end, messaging.batch.message_count set):
// each order's trace stays whole, at the price that a batched span's
// duration includes its neighbours' work. Each handler sees its own
// delivery's span, never a neighbour's. A batch rolled back to be applied
// one delivery at a time ends its spans with an event saying so, and each
// delivery gets a new span for its own transaction. A parked event applied
// in its gap filler's transaction, and a requeued dead letter, get a span
// that continues their own producer's trace too. Without a traceparent the
// span is a root. Only the otel API is used; a nil provider makes no spans.
//
// # The failure windows it closes
//
//   - Crash before commit: the transaction rolls back with the connection;
//     the message was not acked, so JetStream redelivers it after AckWait
//     (5s by default) and it is applied then. A live process reports the
//     deliveries it holds in progress every AckWait/3, so only a dead
//     process's deliveries wait that long, and a slow handler is never
//     redelivered while it runs.
//   - The broker fails (missed heartbeats, JetStream unavailable or without
//     quorum, a leader election, a partition, the durable consumer or the
//     stream deleted): [Consumer.Run] does not return. It subscribes again
//     with capped, jittered backoff, recreating the durable consumer if it
//     is gone, and logs once when the subscription is lost and once when it
//     is back; [Consumer.State] tells which. Pull requests expire after 4s
//     with heartbeats every 1.5s, so a lost subscription is noticed within
//     about 3s.
//   - Crash after commit, before the ack (or a lost ack): the redelivered copy
//     finds its processed_events row and is acked without effect.
//   - Duplicates: the relay may publish an event twice (after a lost PubAck,
//     beyond the stream's duplicate window), an operator may replay a stream.
//     Every copy carries the same event id (Nats-Msg-Id) and meets the same
//     processed_events row.
//   - Reordering and gaps: a redelivery, or a relay retry of an earlier event,
//     can bring Aggregate-Seq 3 before 2. An event beyond cursor+1 is parked
//     in inbox_parked and acked, so that it holds nothing in the broker; the
//     event that fills the gap applies the parked ones in order, in its own
//     transaction (each in a savepoint, so that a failing one does not take
//     the gap filler with it; a sweeper retries it, with backoff and the
//     usual dead letter after MaxDeliver failures). It is never
//     dead-lettered for waiting. [ParkedStats], [ListParked] and
//     [DiscardParked] show and drop what waits.
//   - Duplicates and conflicts: only the same event id is a duplicate.
//     processed_events remembers which event was applied at each sequence, so
//     another event id at an applied sequence (a forged message, a producer
//     bug) is a conflict: dead-lettered as such ([ErrConflict],
//     DeadLetter.ConflictWith names the applied one), counted and logged at
//     ERROR, never dropped quietly. A new id at a passed sequence whose
//     record is gone (older than Retention) is skipped and counted as stale.
//   - Transient errors: a failed handler (an error, a panic, a failed
//     commit) is rolled back, counted in inbox_failures and redelivered with
//     exponential backoff and full jitter; after Config.MaxDeliver failures
//     the message becomes a dead letter. Only an outage is retried without
//     counting: the database unreachable, out of connections or shutting
//     down, a statement cancelled, a serialization failure or deadlock. So
//     an outage creates no dead letters, and no message is retried for
//     ever: any other failure of the inbox's own statements counts like a
//     handler's.
//   - Poison: a message that breaks the header contract (ids and types
//     must be UTF-8 without NUL and at most 1 KiB, Aggregate-Seq at most
//     2⁶³−2, the subject <source>.<Aggregate-Id>.<Event-Type>), one whose
//     values the inbox tables refuse (SQLSTATE class 22), or one whose
//     handler returns [Poison], is a dead letter at once and terminated in
//     JetStream. Dead letters keep subject, headers and payload (what
//     Postgres cannot hold, NUL and invalid UTF-8, as U+FFFD; the payload
//     byte for byte); [RequeueDeadLetter]
//     sends one back through the very same steps, with its original event id
//     and nothing republished to NATS.
//
// With the sequence check on, a dead-lettered event stops its aggregate:
// later events of the aggregate wait, parked, until the dead letter is
// requeued and succeeds, and then follow in order. Events of other aggregates
// are not held up, however many wait: parked messages are acked, so they do
// not count towards the durable consumer's MaxAckPending, which every
// aggregate shares. What does count is what is in flight and what waits out
// a failed handler's backoff (see Config.MaxAckPending).
//
// Several processes may run a Consumer with the same Config.Name. They share
// the durable JetStream consumer, and the row lock on the aggregate's cursor
// makes them take one aggregate's events one at a time: the second's UPDATE
// waits for the first to commit, then re-reads the advanced cursor and no
// longer matches.
//
// # What the sequence check needs
//
// Aggregate-Seq counts the events of an aggregate per producer with no gaps,
// so the consumer must see every one of them: Config.FilterSubjects may
// select producers but must never drop event types. A consumer names the
// types it needs in Config.Handles; the others are only recorded, in no
// transaction of their own. The cursor is keyed by producer
// (the first subject token), aggregate type and aggregate id, as the outbox
// numbers them. Config.SkipSequenceCheck turns the check off
// for consumers that need neither order nor gap detection.
//
// # The windows rule
//
// processed_events rows must be kept longer than any copy of an event can
// still arrive:
//
//	Retention > PublishHorizon   how long the producer may still publish a copy
//	Retention > DuplicateWindow  the stream's JetStream dedupe window
//	Retention > ReplayWindow     how far back an operator may replay the stream
//
// [NewConsumer] refuses a Config that breaks it, and Run also checks the live
// stream's duplicate window. A running Consumer deletes older rows every hour
// (Retention ago and older). The inbox_sequences cursors are never deleted: one row per
// aggregate, and with them even a replay older than Retention is skipped.
package inbox
