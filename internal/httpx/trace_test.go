package httpx

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/go-chi/chi/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func TestTrace(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	var inHandler trace.SpanContext
	r := chi.NewRouter()
	r.Use(Trace(tp))
	r.Get("/healthz", func(http.ResponseWriter, *http.Request) {})
	r.Post("/orders/{id}/cancel", func(w http.ResponseWriter, r *http.Request) {
		inHandler = trace.SpanContextFromContext(r.Context())
		w.WriteHeader(http.StatusConflict)
	})
	serve := func(method, path string, header http.Header) {
		req := httptest.NewRequest(method, path, nil)
		for k, v := range header {
			req.Header[k] = v
		}
		r.ServeHTTP(httptest.NewRecorder(), req)
	}

	t.Run("a span per request named by route, the handler inside it", func(t *testing.T) {
		exp.Reset()
		serve(http.MethodPost, "/orders/o-1/cancel", nil)
		spans := exp.GetSpans()
		if len(spans) != 1 {
			t.Fatalf("%d spans, want 1", len(spans))
		}
		s := spans[0]
		if s.Name != "POST /orders/{id}/cancel" || s.SpanKind != trace.SpanKindServer || s.Parent.IsValid() {
			t.Errorf("span %q kind %s parent %v; want a root server span named by route", s.Name, s.SpanKind, s.Parent.SpanID())
		}
		if inHandler.SpanID() != s.SpanContext.SpanID() {
			t.Errorf("the handler ran in span %s, not the request's %s", inHandler.SpanID(), s.SpanContext.SpanID())
		}
	})
	t.Run("a caller's traceparent is continued", func(t *testing.T) {
		exp.Reset()
		serve(http.MethodPost, "/orders/o-1/cancel", http.Header{"Traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}})
		spans := exp.GetSpans()
		if len(spans) != 1 || spans[0].SpanContext.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" ||
			spans[0].Parent.SpanID().String() != "00f067aa0ba902b7" {
			t.Fatalf("spans %+v; want one child of the caller's span", spans)
		}
	})
	t.Run("probes are not traced", func(t *testing.T) {
		exp.Reset()
		serve(http.MethodGet, "/healthz", nil)
		if n := len(exp.GetSpans()); n != 0 {
			t.Fatalf("%d spans for /healthz, want none", n)
		}
	})
	t.Run("nil provider: no spans, requests served", func(t *testing.T) {
		h := Trace(nil)(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTeapot) }))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/x", nil))
		if rec.Code != http.StatusTeapot {
			t.Fatalf("status %d", rec.Code)
		}
	})
	t.Run("nil provider: a caller's traceparent is not taken up", func(t *testing.T) {
		// The events the handler writes would carry it, and the dashboard
		// would link the order to the client's trace id.
		var sc trace.SpanContext
		h := Trace(nil)(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { sc = trace.SpanContextFromContext(r.Context()) }))
		req := httptest.NewRequest(http.MethodPost, "/orders", nil)
		req.Header.Set("Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
		h.ServeHTTP(httptest.NewRecorder(), req)
		if sc.IsValid() {
			t.Fatalf("the handler runs in trace %s, the caller's; want none", sc.TraceID())
		}
	})
}
