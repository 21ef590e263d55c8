package saga

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Tracing. A transition is a span, "<type> <from> → <to>", a child of the
// span in the caller's ctx: the inbox consumer's for a consumed event, the
// HTTP request's for a command, the scanner's for a fired timeout. A
// timeout keeps the trace context of the transaction that armed it, and
// the scanner's span continues that trace, however much later it fires. It is
// made by the tracer provider of that span, so a saga needs no
// configuration of its own and makes no span where the caller has none.
// The transition's func runs inside it; the outbox events it queues carry
// it on.

const tracerName = "github.com/shop-ref/shop/pkg/saga"

// traceContext is the W3C Trace Context propagator.
var traceContext propagation.TraceContext

// traceHeaders is the trace context of ctx, as a timeout row keeps it
// (traceparent, tracestate); empty without a span.
func traceHeaders(ctx context.Context) map[string]string {
	c := propagation.MapCarrier{}
	traceContext.Inject(ctx, c)
	return c
}

// startTransition starts the span of transition t of instance in.
func startTransition(ctx context.Context, typ string, in Instance, t Transition) (context.Context, trace.Span) {
	tracer := trace.SpanFromContext(ctx).TracerProvider().Tracer(tracerName)
	return tracer.Start(ctx, typ+" "+t.From+" → "+t.To, trace.WithAttributes(
		attribute.String("saga.type", typ),
		attribute.String("saga.id", in.ID),
		attribute.String("saga.event", t.Event),
		attribute.String("saga.from", t.From),
		attribute.String("saga.to", t.To),
		attribute.Int64("saga.version", in.Version+1),
	))
}

func endTransition(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "transition failed")
	}
	span.End()
}
