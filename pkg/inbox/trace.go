package inbox

import (
	"context"
	"strconv"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Tracing. Every delivery the consumer applies is a span of kind consumer
// that continues the producer's trace: its parent is the message's
// traceparent, the relay's publish span (or, from a relay that traces
// nothing, the writer's span the outbox stored with the event; see the
// package documentation for why a child and not a link). The handler runs with that span in its ctx, so the
// events it writes to its own outbox carry the consumer's span, and one
// order stays one trace across every service.

// traceContext is the W3C Trace Context propagator, the contract's
// traceparent header.
var traceContext propagation.TraceContext

// headerCarrier reads and writes trace headers on a nats.Header. It is not
// propagation.HeaderCarrier: that canonicalises keys as HTTP does
// ("Traceparent"), and NATS headers are case-sensitive.
type headerCarrier nats.Header

func (h headerCarrier) Get(key string) string { return nats.Header(h).Get(key) }
func (h headerCarrier) Set(key, value string) { nats.Header(h).Set(key, value) }
func (h headerCarrier) Keys() []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	return keys
}

// How a span came to apply its event, in attribute shop.inbox.path.
const (
	pathDelivery = "delivery" // a delivery from JetStream, alone in its transaction
	pathBatch    = "batch"    // a delivery in a batch transaction it shares
	pathParked   = "parked"   // a parked event, applied after the gap before it was filled
	pathRequeued = "requeued" // a dead letter an operator requeued
)

// startSpan starts the span of applying m, a child of the span that
// produced it, when m carries a traceparent; a root span otherwise.
func (c *Consumer) startSpan(ctx context.Context, m Message, path string, batch int) (context.Context, trace.Span) {
	if m.Header != nil {
		ctx = traceContext.Extract(ctx, headerCarrier(m.Header))
	}
	attrs := []attribute.KeyValue{
		attribute.String("messaging.system", "nats"),
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.destination.name", m.Subject),
		attribute.String("messaging.message.id", m.EventID.String()),
		attribute.String("messaging.consumer.group.name", c.cfg.Name),
		attribute.String("shop.event_type", m.Type),
		attribute.String("shop.aggregate_id", m.AggregateID),
		attribute.Int64("shop.aggregate_seq", m.Seq),
		attribute.String("shop.inbox.path", path),
	}
	if batch > 1 {
		attrs = append(attrs, attribute.Int("messaging.batch.message_count", batch))
	}
	return c.tracer.Start(ctx, "process "+m.Type,
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// endSpan ends span with what became of its event: out, or err.
func endSpan(span trace.Span, out outcome, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "not applied")
	} else {
		span.SetAttributes(attribute.String("shop.inbox.outcome", out.String()))
		if out == conflict {
			span.SetStatus(codes.Error, "conflict")
		}
	}
	span.End()
}

func (o outcome) String() string {
	switch o {
	case applied:
		return "applied"
	case duplicate:
		return "duplicate"
	case stale:
		return "stale"
	case conflict:
		return "conflict"
	case gap:
		return "gap"
	case parked:
		return "parked"
	}
	return strconv.Itoa(int(o))
}
