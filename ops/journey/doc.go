// Package journey reads one order's journey through the shop from the
// tables the services already keep, with no tracing backend: every event of
// the order, when it was committed, when the relay published it, when each
// consumer processed it, the retries, parked and dead messages on the way,
// and the saga's state changes. The dashboard (GET /api/orders/{id}/journey)
// and `shop trace <order-id>` both show what Load returns.
//
// Where each step comes from:
//
//   - committed, published, dead: the producing service's outbox
//     (occurred_at, published_at, dead_at; attempts counts the failed
//     publishes). Every event about an order has the aggregate ("order",
//     order id), whichever service produced it, so one index lookup per
//     outbox finds them all; inventory's ProductUpdated is per SKU and
//     belongs to no order.
//   - processed: processed_events of each consuming service, one row per
//     consumer and event, at the time of the consumer's transaction.
//   - failing: inbox_failures, the attempts of an event that a consumer has
//     not yet applied. The row is deleted when the event is applied, so a
//     retry that ended well leaves no trace here.
//   - dead letter, parked: dead_letters and inbox_parked of each consumer.
//   - state: the order's history (order_history), and the events the saga
//     recorded as unexpected and ignored (saga_unexpected); pending durable
//     timeouts (saga_timeouts) are listed beside the timeline.
//
// What it cannot show: the inbox counts the duplicates it absorbs per
// consumer only (inbox.Consumer.Stats, the consumers' /metrics), not per
// event, so a journey does not say how often an event was delivered. And
// the tables keep their rows for a while only: the outboxes delete
// published events after the relay's retention, the inboxes their
// processed_events rows after theirs, so an old order's journey shows its
// state changes but no longer its events (Journey.Notes says so).
//
// The times come from the databases' clocks (now() of each transaction) and
// from the order service's clock (the history), so hops between services
// that use different database servers include those clocks' skew. A
// consumer may also commit before the relay has recorded the publish it
// read (published_at is written after the broker's ack); Entry.HopFrom
// says from which step a hop was measured.
package journey
