package inbox

import (
	"context"
	"crypto/rand"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// Each applied event's span is a child of the span that produced it (the
// message's traceparent), alone or in a batch, and the handler runs in
// that span, so what it writes to its own outbox continues the trace.
func TestSpanContinuesTheProducersTrace(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		batchSize int
	}{{"alone", 1}, {"in a batch", 64}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			producers := map[uuid.UUID]trace.SpanContext{}
			for seq := int64(1); seq <= 5; seq++ {
				for _, agg := range []string{"t-1", "t-2", "t-3", "t-4"} {
					ev := newEvent(agg, seq)
					sc := randomSpanContext(t)
					m := ev.msg()
					traceContext.Inject(trace.ContextWithSpanContext(context.Background(), sc), headerCarrier(m.Header))
					producers[ev.id] = sc
					e.publishMsg(t, m)
				}
			}
			exp := tracetest.NewInMemoryExporter()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
			var mu sync.Mutex
			seen := map[uuid.UUID]trace.SpanContext{} // the span each handler ran in
			cfg := e.config(t, func(ctx context.Context, tx pgx.Tx, m Message) error {
				mu.Lock()
				seen[m.EventID] = trace.SpanContextFromContext(ctx)
				mu.Unlock()
				return record("")(ctx, tx, m)
			})
			cfg.BatchSize, cfg.TracerProvider = tc.batchSize, tp
			c := e.consumer(t, e.pool, e.js, cfg)
			run(t, c)
			eventually(t, "every event is applied", func() bool { return e.count(t, `SELECT count(*) FROM effects`) == 20 })
			// A delivery's span ends after its commit (it records the
			// outcome): wait for what the checks read, every event's span.
			var spans map[uuid.UUID]tracetest.SpanStub
			eventually(t, "every event's span", func() bool {
				spans = map[uuid.UUID]tracetest.SpanStub{}
				for _, s := range exp.GetSpans() {
					for _, a := range s.Attributes {
						if a.Key == "messaging.message.id" {
							spans[uuid.MustParse(a.Value.AsString())] = s
						}
					}
				}
				return len(spans) >= len(producers)
			})
			mu.Lock()
			defer mu.Unlock()
			for id, producer := range producers {
				s, ok := spans[id]
				switch {
				case !ok:
					t.Errorf("event %s: no span", id)
				case s.SpanKind != trace.SpanKindConsumer || s.Name != "process OrderCreated":
					t.Errorf("event %s: span %q of kind %s", id, s.Name, s.SpanKind)
				case s.SpanContext.TraceID() != producer.TraceID() || s.Parent.SpanID() != producer.SpanID() || !s.Parent.IsRemote():
					t.Errorf("event %s: span %s with parent %s, want a child of the producer's %s",
						id, s.SpanContext.SpanID(), s.Parent.SpanID(), producer.SpanID())
				case seen[id].SpanID() != s.SpanContext.SpanID():
					t.Errorf("event %s: the handler ran in span %s, not the event's %s", id, seen[id].SpanID(), s.SpanContext.SpanID())
				}
			}
			if tc.batchSize > 1 && c.Counters().Batches == 0 {
				t.Log("no batch formed this time; the spans were checked one delivery at a time")
			}
		})
	}
}

func randomSpanContext(t *testing.T) trace.SpanContext {
	t.Helper()
	var tid trace.TraceID
	var sid trace.SpanID
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true})
}
