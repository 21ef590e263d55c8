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
// Round trips are the cost that matters on a busy database, so writes ride
// on batches the code sends anyway. A func queues its writes on
// [Step.Batch] (outbox events through outbox.Writer.Queue), and Apply sends
// them with the new state and timeouts: a transition is the lock, the
// func's own reads if any, and one batch. [Saga.QueueStart] puts the new
// instance, and the timeouts of its first state ([Timeout]), into the batch
// that writes the business row starting it.
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
// # Failure windows closed
//
//   - Crash between the state change and its events: impossible, they are
//     one transaction.
//   - Duplicate delivery: the caller's inbox drops the copy before Apply
//     runs. Apply itself is not idempotent by event id; a copy that did reach
//     it finds the instance moved on and is recorded as unexpected.
//   - Events in an unexpected order or state (a reservation for an order
//     already closed): there is no transition for (state, event), so the
//     event is recorded in saga_unexpected and ignored. Apply returns no
//     error, because retrying or dead-lettering could never make it fit and
//     would only hold the consumer back.
//   - Crash while a timeout is pending: timeouts are rows, set and cancelled
//     in the transition's transaction (or armed with the instance at Start);
//     a timeout that fell due while no process ran fires on the next scan.
//   - An instance waiting for an answer that never comes (the first state's
//     event lost, its producer down for good): a Timeout given to Start
//     bounds the wait from the very first state.
//   - Two scanners: each claims due timeouts (up to ScannerConfig.BatchSize)
//     with FOR UPDATE SKIP LOCKED, deletes their rows and applies them in one
//     short transaction, so a timeout fires once; a scanner that crashes
//     mid-way rolls back and leaves them to fire. A transition that fails
//     rolls its batch back; the same timeouts then fire one per
//     transaction, and only the failing one is postponed.
//   - Timeout racing an event (payment arrives as the timeout falls due): both
//     need the instance row lock; whichever commits first wins, and the other
//     finds a state with no transition for it (the timeout was cancelled, or
//     the late event is unexpected) or, in the scanner's case, skips the
//     locked instance until the next scan.
//
// # Traces
//
// Each transition is a span, "<type> <from> → <to>" with saga.id,
// saga.from, saga.to and saga.event, a child of the span in the caller's
// ctx and made by that span's tracer provider (no span without one). A
// timeout keeps the trace context of the transaction that armed it
// (traceparent, tracestate, in saga_timeouts.trace_headers); the
// Scanner's span for a fired timeout, "saga timeout <name>", continues
// that trace, so a deadline that fires long after belongs to the same trace
// as the transition that set it. Only the otel API is used.
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
