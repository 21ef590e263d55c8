// Package saga runs orchestrated sagas on Postgres: a saga instance is a row
// with a state, and declared transitions move it when events arrive, each
// inside the transaction that consumed the event.
//
// # The pattern
//
// A [Saga] is a type name and a table of [Transition]s, (state, event type) →
// new state plus a [TransitionFunc] that does the work: business rows, outbox
// events (pkg/outbox, in the same tx), timeouts to set or cancel. [Saga.Start]
// creates an instance in the caller's transaction; [Saga.Apply] runs one
// transition in the caller's transaction, normally the inbox transaction of
// pkg/inbox, so that
//
//	the new state + its outbox events + its timeouts + processed_events
//
// commit together or not at all. Apply locks the instance row (FOR UPDATE),
// so events of one instance take turns across consumers and processes, and
// bumps its version.
//
// A func queues its writes on [Step.Batch] (outbox events through
// outbox.Writer.Queue), and Apply sends them with the new state and
// timeouts: a transition is the lock, the func's own reads if any, and one
// round trip. [Saga.QueueStart] likewise puts the new instance and the
// timeouts of its first state ([Timeout]) into the caller's batch.
//
// A consumer that applies a batch of deliveries in one transaction
// (a pkg/inbox handler) hands them to [Saga.ApplyBatch]: one
// round trip locks every instance of the batch, in id order, the funcs run
// in stream order on the instances as the batch's earlier events left them,
// and one round trip saves everything, where Apply in turn takes two per
// event. A func's reads then run before the writes of the batch's earlier
// transitions of other instances are sent, so ApplyBatch suits funcs that
// read only their own instance's rows; a second event of one instance has
// what is queued sent first.
//
// A [Scanner] fires durable timeouts: a due timeout is applied as an event of
// type "timeout:<name>" ([TimeoutEvent]).
//
// # Guarantees
//
//   - A state change and its events, timeouts and processed_events row
//     commit together or not at all.
//   - Apply is not idempotent by event id: the caller's inbox drops copies.
//     An event with no transition from the instance's state (a late reply,
//     a reply for an instance already closed) is recorded in saga_unexpected
//     and ignored, with no error: retrying could never make it fit.
//   - Timeouts are rows, set and cancelled in the transition's transaction;
//     one that fell due while no process ran fires on the next scan, and a
//     Timeout given to Start bounds the wait from the very first state.
//   - Each timeout fires once, however many scanners run; a scanner that
//     crashes leaves its claims to fire later, and a failing transition
//     postpones only its own timeout.
//   - A timeout racing an event: both take the instance's row lock, and the
//     loser finds no transition for it.
//
// Each transition is a span, "<type> <from> → <to>", a child of the span in
// ctx. A timeout keeps the trace context of the transaction that armed it,
// and its firing continues that trace.
//
// # Tables
//
// Apply and the Scanner expect these tables in the current schema, which
// pkg/saga/migrations creates (embedded; the shop's migrations/ applies it
// to the order schema):
//
//	saga_instances  (id text PK, type, state, version, data jsonb, created_at, updated_at)
//	saga_timeouts   (saga_id → saga_instances, name, due_at, trace_headers jsonb; PK (saga_id, name))
//	saga_unexpected (id, saga_id, saga_type, state NULL = no instance, event_type, event_id, recorded_at)
package saga
