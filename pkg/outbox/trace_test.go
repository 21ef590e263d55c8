package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// The span in the writer's ctx travels with the event: written into the
// row's headers in the business transaction, published by the relay as the
// message's traceparent and tracestate.
func TestTraceContextOfCtxReachesTheMessage(t *testing.T) {
	forEachMode(t, testTraceContextOfCtxReachesTheMessage)
}

func testTraceContextOfCtxReachesTheMessage(t *testing.T, mode Mode) {
	e := setup(t)
	e.run(t, mode, Config{})
	var w Writer
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: trace.FlagsSampled,
	})
	ts, err := trace.ParseTraceState("shop=1")
	if err != nil {
		t.Fatal(err)
	}
	ctx := trace.ContextWithSpanContext(context.Background(), sc.WithTraceState(ts))

	traced := event("o-1", "OrderCreated")
	traced.Headers = nil
	own := event("o-1", "OrderPaid") // a trace context the caller set wins, whole
	own.Headers = map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		return w.Add(ctx, tx, traced, own)
	}); err != nil {
		t.Fatal(err)
	}
	var untraced int
	if err := e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE NOT headers ? 'traceparent'`).Scan(&untraced); err != nil || untraced != 0 {
		t.Fatalf("rows without traceparent: %d (%v)", untraced, err)
	}
	eventually(t, 10*time.Second, "events published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 2, nil
	})
	for subject, want := range map[string]string{
		"ev.o-1.OrderCreated": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"ev.o-1.OrderPaid":    own.Headers["traceparent"],
	} {
		msg, err := e.stream.GetLastMsgForSubject(ctx, subject)
		if err != nil {
			t.Fatal(err)
		}
		if got := msg.Header.Get("traceparent"); got != want {
			t.Errorf("%s: traceparent = %q, want %q", subject, got, want)
		}
	}
	msg, err := e.stream.GetLastMsgForSubject(ctx, "ev.o-1.OrderCreated")
	if err != nil {
		t.Fatal(err)
	}
	if got := msg.Header.Get("tracestate"); got != "shop=1" {
		t.Errorf("tracestate = %q, want shop=1", got)
	}
	// ctx's tracestate belongs to ctx's trace, not to the event's own.
	msg, err = e.stream.GetLastMsgForSubject(ctx, "ev.o-1.OrderPaid")
	if err != nil {
		t.Fatal(err)
	}
	if got := msg.Header.Get("tracestate"); got != "" {
		t.Errorf("an event with its own traceparent was given ctx's tracestate %q", got)
	}
}

// With a tracer provider, each traced event's publish is a producer span:
// a child of the writer's span, started when the relay publishes (after
// the commit: the wait in the outbox is the gap before it), ended at the
// ack, and the message carries its context, so consumers' spans are its
// children. An event the broker never takes ends its span in error; an
// untraced event stays untraced. In ModeCDC the stream publishes both
// and the poison dies there.
func TestThePublishIsASpanBetweenTheWriterAndTheConsumers(t *testing.T) {
	forEachMode(t, testThePublishIsASpanBetweenTheWriterAndTheConsumers)
}

func testThePublishIsASpanBetweenTheWriterAndTheConsumers(t *testing.T, mode Mode) {
	e := setup(t)
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	e.run(t, mode, Config{TracerProvider: tp})
	writer, write := tp.Tracer("test").Start(context.Background(), "POST /orders")
	var w Writer
	traced := event("o-1", "OrderCreated")
	traced.Headers = nil
	poison := event("o-2", "OrderCreated")
	poison.Headers = map[string]string{"bad header": "x"} // no message can carry it: dead at once
	untraced := event("o-3", "OrderCreated")
	untraced.Headers = nil
	// The commit's start: a streaming relay may publish before BeginFunc
	// has returned, so the time after it is no bound.
	var committing time.Time
	if err := pgx.BeginFunc(writer, e.db.Pool, func(tx pgx.Tx) error {
		if err := w.Add(writer, tx, traced, poison); err != nil {
			return err
		}
		err := w.Add(context.Background(), tx, untraced)
		committing = time.Now()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	write.End()
	eventually(t, 10*time.Second, "events settled", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL OR dead_at IS NOT NULL") == 3, nil
	})

	byName := map[string][]tracetest.SpanStub{}
	for _, s := range spans.GetSpans() {
		byName[s.Name] = append(byName[s.Name], s)
	}
	pubs := byName["publish OrderCreated"]
	if len(pubs) != 2 {
		t.Fatalf("publish spans: %d, want 2 (the traced event's and the poison's; none for the untraced one)", len(pubs))
	}
	var ok, failed tracetest.SpanStub
	for _, s := range pubs {
		if s.Status.Code == codes.Error {
			failed = s
		} else {
			ok = s
		}
	}
	if !ok.SpanContext.IsValid() || !failed.SpanContext.IsValid() {
		t.Fatalf("want one publish span ok and one in error; got %+v", pubs)
	}
	if ok.Parent.SpanID() != write.SpanContext().SpanID() || ok.SpanContext.TraceID() != write.SpanContext().TraceID() {
		t.Errorf("publish span's parent %s, want the writer's span %s", ok.Parent.SpanID(), write.SpanContext().SpanID())
	}
	if ok.SpanKind != trace.SpanKindProducer {
		t.Errorf("publish span kind %v, want producer", ok.SpanKind)
	}
	if ok.StartTime.Before(committing) {
		t.Errorf("publish span started %v, before the commit at %v", ok.StartTime, committing)
	}
	want := map[string]string{
		"messaging.system":           "nats",
		"messaging.operation.type":   "send",
		"messaging.destination.name": "ev.o-1.OrderCreated",
	}
	got := map[string]string{}
	for _, a := range ok.Attributes {
		got[string(a.Key)] = a.Value.Emit()
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("publish span %s = %q, want %q", k, got[k], v)
		}
	}
	msg, err := e.stream.GetLastMsgForSubject(context.Background(), "ev.o-1.OrderCreated")
	if err != nil {
		t.Fatal(err)
	}
	if id := msg.Header.Get("Nats-Msg-Id"); got["messaging.message.id"] != id {
		t.Errorf("messaging.message.id = %q, want the event id %q", got["messaging.message.id"], id)
	}
	carried := traceContext.Extract(context.Background(), propagation.MapCarrier{"traceparent": msg.Header.Get("traceparent")})
	if sc := trace.SpanContextFromContext(carried); sc.SpanID() != ok.SpanContext.SpanID() {
		t.Errorf("the message carries span %s, want the publish span %s", sc.SpanID(), ok.SpanContext.SpanID())
	}
	msg, err = e.stream.GetLastMsgForSubject(context.Background(), "ev.o-3.OrderCreated")
	if err != nil {
		t.Fatal(err)
	}
	if tp := msg.Header.Get("traceparent"); tp != "" {
		t.Errorf("an untraced event was published with traceparent %q", tp)
	}
}
