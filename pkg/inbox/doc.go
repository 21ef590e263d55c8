// Package inbox consumes events from NATS JetStream so that each one takes
// effect exactly once, in order per aggregate: the consuming half of the
// transactional outbox (pkg/outbox is the producing half).
//
// JetStream delivers at least once. A [Consumer] applies events in a
// Postgres transaction that also moves each aggregate's cursor from
// Aggregate-Seq−1 to Aggregate-Seq and records the event id in
// processed_events, and acks only after the commit: a copy meets its record
// and changes nothing. The [HandlerFunc] gets that transaction, so its
// effects (and the events it writes to its own outbox) commit with the
// record or not at all. It always takes a batch: what a worker has waiting
// (up to Config.BatchSize), or one event; [Each] adapts a handler of one
// event. One aggregate's events go to one worker, in order.
//
// Guarantees:
//
//   - A crash before the commit is rolled back and redelivered after
//     AckWait; a crash after it, or any other copy of an event, is acked
//     without effect.
//   - Another event id at an applied sequence is a conflict, dead-lettered
//     ([ErrConflict]). An event beyond its aggregate's next sequence is
//     parked and acked, and applied in order once the gap is filled.
//   - A failing handler is retried with backoff and dead-lettered after
//     MaxDeliver failures (a database outage does not count); a message
//     that does not decode, or whose handler returns [Poison], at once. A
//     failed batch is retried one delivery at a time, so the bad one fails
//     alone. [RequeueDeadLetter] applies one again, with its event id.
//   - A message the server copied into the stream from another stream (a
//     stream's republish or sources; their Nats-Stream and
//     Nats-Stream-Source headers) is dead-lettered at once, [ErrForged],
//     and never applied, requeued or not: a republish ignores what its
//     original's publisher may publish to, so the copy may carry any
//     producer's subject and headers. A consumer reads the stream its
//     producers publish to, never one fed by republish or sources.
//   - No broker failure ends [Consumer.Run]; it subscribes again with
//     backoff ([Consumer.State]).
//   - Consumers sharing a Config.Name, in any number of processes, share
//     the work; an aggregate's events still apply in turn.
//   - With Config.TracerProvider, each delivery is a span, the child of its
//     producer's, and the handler runs in it.
//
// A consumer must see every event of an aggregate: Config.FilterSubjects
// may select producers, never event types. Config.Retention must outlast
// every copy of an event that can still come. docs/architecture.md explains
// how each guarantee holds.
package inbox
