package outbox

import (
	"context"
	"maps"

	"go.opentelemetry.io/otel/propagation"
)

// traceContext is the W3C Trace Context propagator, the contract's
// traceparent header. It is the otel API's, not the SDK's: the outbox reads
// whatever span the caller's ctx holds and needs no tracer of its own.
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
