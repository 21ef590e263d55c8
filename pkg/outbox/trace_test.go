package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"
)

// The span in the writer's ctx travels with the event: written into the
// row's headers in the business transaction, published by the relay as the
// message's traceparent and tracestate.
func TestTraceContextOfCtxReachesTheMessage(t *testing.T) {
	e := setup(t)
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
	start(t, e.relay(t, Config{}))
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
