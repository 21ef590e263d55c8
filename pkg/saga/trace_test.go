package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/shop-ref/shop/pkg/saga"
)

// A transition is a span, a child of the caller's, made by the caller's
// provider, naming the instance and the move; a fired timeout is a span of
// the scanner's provider around its transition, continuing the trace of
// the transition that armed it.
func TestTransitionsAndTimeoutsAreSpans(t *testing.T) {
	t.Parallel()
	e := setup(t, time.Millisecond)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	e.start(t, "a")

	ctx, parent := tp.Tracer("test").Start(context.Background(), "consumer")
	if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		_, err := e.ticket.Apply(ctx, tx, "a", saga.Event{Type: "Reserve"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	parent.End()
	sc, err := saga.NewScanner(e.db.Pool, saga.ScannerConfig{TracerProvider: tp}, e.ticket)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the hold to fire", func() bool {
		fired, err := sc.FireOne(context.Background())
		return err == nil && fired
	})

	byName := map[string]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		byName[s.Name] = s
	}
	want := map[string]map[string]string{
		"ticket OPEN → HELD":    {"saga.id": "a", "saga.from": "OPEN", "saga.to": "HELD", "saga.event": "Reserve"},
		"ticket HELD → EXPIRED": {"saga.id": "a", "saga.from": "HELD", "saga.to": "EXPIRED", "saga.event": "timeout:hold"},
		"saga timeout hold":     {"saga.id": "a", "saga.timeout": "hold"},
	}
	for name, attrs := range want {
		s, ok := byName[name]
		if !ok {
			t.Errorf("no span %q among %d", name, len(byName))
			continue
		}
		for k, v := range attrs {
			if got := attrOf(s, k); got != v {
				t.Errorf("span %q: %s = %q, want %q", name, k, got, v)
			}
		}
	}
	if got := byName["ticket OPEN → HELD"].Parent.SpanID(); got != parent.SpanContext().SpanID() {
		t.Errorf("transition's parent %s, want the caller's span", got)
	}
	if got := byName["ticket HELD → EXPIRED"].Parent.SpanID(); got != byName["saga timeout hold"].SpanContext.SpanID() {
		t.Errorf("the timeout's transition has parent %s, want the scanner's span", got)
	}
	// The timeout kept the context of the transition that armed it.
	if got, want := byName["saga timeout hold"].Parent.SpanID(), byName["ticket OPEN → HELD"].SpanContext.SpanID(); got != want {
		t.Errorf("the fired timeout's span has parent %s, want the arming transition's %s", got, want)
	}
}

func attrOf(s tracetest.SpanStub, key string) string {
	for _, a := range s.Attributes {
		if string(a.Key) == key {
			return a.Value.Emit()
		}
	}
	return ""
}
