package httpx

import (
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// untraced are the probes' paths: a span per health check or scrape would
// bury the requests a reader looks for.
var untraced = map[string]bool{"/healthz": true, "/readyz": true, "/metrics": true}

// Trace is router middleware that makes a server span of every request but
// the probes', named by method and chi route pattern ("POST /orders"), read
// after the handler ran, when routing has filled it in. A request that
// carries a W3C traceparent continues its caller's trace. The handler runs
// in the span, so the events it writes to the outbox carry it.
//
// tp nil (tracing off): no spans, and a caller's traceparent is not taken
// up either. Continued without a span of the shop's, it would reach the
// outbox as the events' trace context, and the dashboard would link the
// order to a trace id of the client's choosing that nothing recorded.
func Trace(tp trace.TracerProvider) func(http.Handler) http.Handler {
	if tp == nil {
		return func(next http.Handler) http.Handler { return next }
	}
	tracer := tp.Tracer("github.com/shop-ref/shop/internal/httpx")
	var tc propagation.TraceContext
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if untraced[r.URL.Path] {
				next.ServeHTTP(w, r)
				return
			}
			ctx := tc.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
			ctx, span := tracer.Start(ctx, r.Method, trace.WithSpanKind(trace.SpanKindServer),
				trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path)))
			defer span.End()
			ww := middleware.NewWrapResponseWriter(w, r.ProtoMajor)
			next.ServeHTTP(ww, r.WithContext(ctx))

			if rc := chi.RouteContext(r.Context()); rc != nil && rc.RoutePattern() != "" {
				span.SetName(r.Method + " " + rc.RoutePattern())
				span.SetAttributes(attribute.String("http.route", rc.RoutePattern()))
			}
			code := ww.Status()
			if code == 0 {
				code = http.StatusOK
			}
			span.SetAttributes(attribute.Int("http.response.status_code", code))
			if code >= 500 {
				span.SetStatus(codes.Error, http.StatusText(code))
			}
		})
	}
}
