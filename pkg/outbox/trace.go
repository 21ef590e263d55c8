package outbox

import (
	"context"
	"maps"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// traceContext is the W3C Trace Context propagator, the contract's
// traceparent header. It is the otel API's, not the SDK's: the writer reads
// whatever span the caller's ctx holds and needs no tracer of its own; the
// relay starts spans only with Config.TracerProvider.
var traceContext propagation.TraceContext

// traceHeaders is the trace context of ctx as message headers (traceparent,
// and tracestate when there is one); nil when ctx holds no valid span.
func traceHeaders(ctx context.Context) map[string]string {
	c := propagation.MapCarrier{}
	traceContext.Inject(ctx, c)
	if len(c) == 0 {
		return nil
	}
	return c
}

// withTrace is an event's headers with the trace headers added; a header
// the caller set itself wins. An event that carries its own traceparent
// keeps its own trace context whole: a batch handler gives each event the
// trace of the delivery that caused it, and ctx's tracestate belongs to
// another trace. It copies rather than writes to the caller's map, which
// may be shared between events.
func withTrace(headers, trace map[string]string) map[string]string {
	if _, own := headers["traceparent"]; own {
		trace = nil
	}
	out := make(map[string]string, len(headers)+len(trace))
	maps.Copy(out, trace)
	maps.Copy(out, headers)
	return out
}

// startPublishSpan starts the span of publishing ev: a producer span, a
// child of the span that wrote the event (the traceparent stored with its
// row), started now, when the relay hands it to the broker. The gap
// between the writer's span and this one is the event's wait in the
// outbox. It returns nil, and starts nothing, when the relay has no tracer
// or the event no trace context: an untraced change stays untraced.
func (r *Relay) startPublishSpan(ctx context.Context, ev row) trace.Span {
	if r.tracer == nil {
		return nil
	}
	ctx = traceContext.Extract(ctx, propagation.MapCarrier(ev.headers))
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	_, span := r.tracer.Start(ctx, "publish "+ev.typ, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.operation.name", "publish"),
			attribute.String("messaging.destination.name", ev.subject),
			attribute.String("messaging.message.id", ev.id.String()),
			attribute.String("shop.event_type", ev.typ),
			attribute.String("shop.aggregate_id", ev.aggID),
			attribute.Int64("shop.aggregate_seq", ev.seq),
			attribute.Int("shop.outbox.attempt", ev.attempts+1),
		))
	return span
}

// carryPublishSpan makes msg carry span's context instead of the writer's,
// so that the consumers' spans are children of the publish, and the trace
// reads write → publish → process.
func carryPublishSpan(msg *nats.Msg, span trace.Span) {
	if span == nil {
		return
	}
	c := propagation.MapCarrier{}
	traceContext.Inject(trace.ContextWithSpan(context.Background(), span), c)
	for k, v := range c {
		msg.Header.Set(k, v)
	}
}

// endPublishSpan ends span with the broker's answer, res.
func endPublishSpan(span trace.Span, res result) {
	if span == nil {
		return
	}
	switch {
	case res.err != nil:
		span.RecordError(res.err)
		span.SetStatus(codes.Error, "not published")
	case res.duplicate:
		// The stream had stored an earlier copy: a retry whose first ack
		// was lost, not a second message.
		span.SetAttributes(attribute.Bool("shop.outbox.duplicate", true))
	}
	span.End()
}
