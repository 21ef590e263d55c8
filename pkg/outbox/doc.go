// Package outbox is a transactional outbox for Postgres and NATS JetStream:
// a business change and the events that describe it commit in one local
// transaction, and a relay publishes the committed events afterwards.
//
// # Writing
//
// [Writer.Add] inserts events inside the caller's pgx.Tx. They commit or roll
// back with the business rows: a committed change always has its events, a
// rolled-back change never does. Each event gets a UUIDv7 id, stable forever
// (it is the Nats-Msg-Id of every copy ever published), and the next number
// of its aggregate's sequence, 1, 2, 3 …, taken under a row lock on the
// aggregate's counter so that two transactions on one order take turns and a
// rollback leaves no gap. [Writer.Queue] queues the same statements into a
// pgx.Batch that the caller sends on its transaction with its own writes, so
// that the events cost no round trip of their own.
//
// A writer owns its service's subject rule: with [Writer.Prefix] set, an
// event that leaves Subject empty is published on
// <prefix>.<aggregate id>.<type>, and an id or type that is not one
// subject token is refused before anything is written, instead of landing
// on a subject no consumer's filter matches.
//
// # Trace context
//
// [Writer.Add] and [Writer.Queue] write the trace context of their ctx (the
// span the caller is in: an HTTP request's, an inbox consumer's) into each
// event's headers, as the W3C traceparent and, when there is one,
// tracestate: in the same statement, and so the same transaction, as the
// event. Whenever the event is published, by whichever relay and however
// late, the message carries the context of the change that wrote it, and a
// consumer continues that trace (pkg/inbox). A traceparent the caller put
// in Event.Headers itself is kept, and ctx's trace context is then left out
// of that event whole (its tracestate belongs to another trace): a batch
// handler queues each event with the trace of the delivery that caused it.
// With no span in ctx no trace header is written.
//
// The package uses only the OpenTelemetry API and its propagation package,
// never the SDK or global state: whichever tracer provider made the span,
// or none, the outbox works the same.
//
// # Relaying
//
// A [Relay] loops: claim, publish, mark.
//
//   - Claim, in one short transaction: up to BatchSize events, each the oldest
//     unpublished event of its aggregate (so k+1 is never sent before k is
//     acked), due (available_at), and not leased. The claim is a lease
//     committed on the rows (claimed_by, a fresh claim_token, claim_until),
//     taken with FOR UPDATE SKIP LOCKED so relays claim side by side. No
//     database lock is held while publishing.
//   - Publish the whole batch asynchronously, Nats-Msg-Id = event id, with the
//     contract's headers, then wait for every PubAck.
//   - Mark the acked events published with an UPDATE fenced by the claim
//     token. Failures are recorded the same way: transient ones bump attempts
//     and wait out an exponential, fully jittered, capped backoff; permanent
//     ones (message too large, invalid headers) and events past MaxAttempts
//     become dead: kept, counted by [ReadStats],
//     listed by [ListDead], and put back by [Requeue]. They are never deleted
//     and never retried forever.
//
// LISTEN/NOTIFY wakes the relay when events commit; polling every
// PollInterval is the fallback. Published events older than Retention are
// deleted in small batches; pending and dead ones never are.
//
// # Failure windows closed
//
//   - Crash after the business commit, before publishing: the event is a
//     committed row; a relay publishes it whenever one runs.
//   - Rollback: the event rolls back with the change; nothing is published.
//   - Relay crash after claiming: the dead relay stops saying it is alive
//     (outbox_relays, renewed every second for three), and any relay claims
//     its rows within seconds; a claim whose relay never said so waits for
//     its lease to expire (expired leases need no sweeper: they are
//     claimable).
//   - Broker timeout or lost connection: the result is unknown, so the event
//     is retried with the same id; the stream's duplicate window drops a copy
//     that was stored.
//   - Broker outage (connection down, JetStream switched off, without quorum
//     or electing a leader, every publish of a batch unanswered): not the
//     events' failure. While the connection is down the relay claims
//     nothing; otherwise the batch is handed back with no attempt counted,
//     the relay pauses (at most OutageBackoffMax) and claims nothing until
//     JetStream answers an API call, then one event, then whole batches.
//     However long the outage, no event dies of it, and a relay cut off
//     alone leaves the events to the relays that can publish them.
//   - No stream takes an event's subject (a cluster that came back empty,
//     a deleted stream): the broker's loss, not the event's. The event is
//     handed back uncounted, as in an outage, and published once the
//     stream's owner has created it again; the relay warns, with the
//     subject, at most every 30 s meanwhile. The one extra call the relay makes (which stream takes a
//     subject, to tell "no stream" from "JetStream away") is bounded at 2s,
//     so a leader election cannot hold a batch for its whole deadline.
//   - Crash after the PubAck, before marking: the lease expires and the event
//     is published again; the stream drops the copy inside its duplicate
//     window and consumers' inboxes (pkg/inbox) drop it after. Marking first
//     would lose events instead; duplicates are the side we choose.
//   - Stale relay (paused past its lease while another took over): its mark or
//     failure update matches no row, because the claim token changed.
//   - Poison event: it becomes dead after a permanent error or MaxAttempts,
//     holding back only the later events of its own aggregate.
//
// One window the relay cannot close alone: the broker acknowledges an event
// and loses it later (an OS crash before its fsync — nats-server syncs every
// two minutes unless told to sync always — a failed disk, a message deleted
// by hand). The event is marked published and is never sent again by
// itself. Finding such events takes the stream (internal/verify's stream
// audit); [RepublishAll] then sends them again, same ids, in order.
//
// Delivery is therefore at least once. Exactly-once effects are the
// consumer's job (pkg/inbox); RetryHorizon tells it how long copies can come.
//
// # Per-row claims or shard ownership
//
// Two designs keep relays apart, and [Config.ShardOwnership] chooses; every
// relay of a schema must use the same one. Per-row claims (above, the
// default) write a lease on every claimed row. With shard ownership each
// relay worker is a member that leases hash shards of the aggregates (32
// rows in outbox_shards: owner, epoch, lease expiry; members heartbeat in
// outbox_relays). A member owns its fair share, the shards divided by the
// live members rounded up. Between two batches, at most every quarter
// second, a member renews its leases, gives back its surplus when another
// member has arrived and takes free or expired shards when it has fewer;
// it gives its shards back when it stops. It reads its shards in
// event order, with the same oldest-unpublished-of-its-aggregate predicate,
// and writes nothing until it marks: one statement per batch, fenced by the
// epochs it read under. Every change of owner raises the shard's epoch, and
// a mark or failure update joins the shard rows under those epochs with
// FOR SHARE: a takeover passes over a shard while an update holds it (and
// takes it at a later round), and a stale owner (paused past its lease)
// changes nothing. Windows it adds:
//
//   - Owner dies: its leases expire (LeaseDuration) and live members take
//     its shards over under new epochs (counted as TakenOver, per shard).
//   - Owner paused past its lease while another took the shard over: both
//     may publish an event of the shard once more (same ids: the stream's
//     duplicate window or the inbox drops the copy), but its next renewal
//     finds the shards gone and it reads them no more, and its marks and
//     failure updates match no row.
//   - Rebalance: a member gives a shard back only between its batches, and
//     the next owner reads the shard's oldest unpublished events, so each
//     aggregate's events still go out in sequence.
//
// Per-row claims stay the default. A shard owner writes one row less per
// event, so its database work alone is faster, but where the relay shares
// its cores with the broker and the database the claim write is not what
// bounds it; what shard ownership buys is relays that do not contend with
// each other, so it is the mode to try where each relay has cores of its
// own. The figures are in docs/performance.md ("Design choices the
// figures justify").
//
// The sequence check in the claim makes a backlog of many events of one
// aggregate drain one event per round trip; orders have a handful of events
// each, so batches stay full across aggregates.
package outbox
