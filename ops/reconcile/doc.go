// Package reconcile finds what retries cannot: orders stuck in one state far
// longer than the saga allows, payments captured for orders that are not
// paid by them and were never refunded, and stock still reserved for orders
// whose saga has ended. `shop all` runs it every minute (cmd/shop/app) and
// `shop verify -repair` runs it once.
//
// Like ops/verify it is an operator's tool: it reads every service's
// schema. It never edits a service's business tables. Its only repair is
// the one that is always safe: when an event about an order it found
// (stuck, with a payment to refund or stock still held) was published by
// one service and the consumer that should have acted on it never processed
// it (the message was lost: a purged stream, a consumer recreated past it,
// a dead letter resolved by hand), the producer's outbox row is marked
// unpublished again (outbox.Republish), so the producer's own relay
// publishes the same immutable event, with the same id and Aggregate-Seq,
// once more. Consumers are idempotent by event id and sequence, so a copy
// of an event they did process changes nothing; one they missed takes the
// normal saga path. Events are republished in sequence order, so the
// relay's per-aggregate ordering holds for the copies too.
//
// With Config.JetStream it also audits every service's stream against its
// outbox (verify.AuditStreams): an event the outbox marked published that
// the stream no longer holds — acknowledged by the broker, then lost in an
// OS crash before its fsync, on a failed disk, or deleted by hand — reached
// no consumer that had not read it yet, and the relay never sends it again
// by itself. With Repair every such event is republished (outbox.RepublishAll,
// one statement per service): the relay sends the copies with their ids and
// sequences, in order per aggregate; a consumer that had applied the event
// absorbs the copy, one that had not applies it.
//
// With Repair it also puts back (outbox.Requeue) every dead event that a
// relay made dead because its stream was missing — an empty cluster, before
// relays waited a missing stream out: the broker's loss, not the event's,
// and until it goes out its aggregate's later events wait behind it. Dead
// events of any other cause stay dead for an operator.
//
// Everything else is reported only, as log lines and counts (Counts), for a
// person to look at: an order whose events were all processed and that is
// still stuck has a bug or a stopped component (the saga timeout scanner,
// the refund loop) that republishing cannot fix, and an event already
// deleted by outbox retention cannot be republished.
package reconcile
