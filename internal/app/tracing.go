package app

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Tracing. Each service has its own tracer provider, passed down through
// its configuration (never the otel global one): in `shop all` the four
// services are four service.names in the trace, as four processes would
// be. The libraries only see a trace.TracerProvider, and nil means no
// spans.

// traceShutdownTimeout bounds the flush of the spans still buffered when
// the process stops.
const traceShutdownTimeout = 5 * time.Second

// newExportingTracerProvider returns a provider for service that exports
// over OTLP/HTTP, configured by the standard OTEL_* variables (endpoint,
// headers, timeout, sampler, batch processor, resource attributes), with
// service.name "shop-<service>". Its Shutdown flushes what is buffered.
func newExportingTracerProvider(ctx context.Context, service string) (*sdktrace.TracerProvider, error) {
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: otlp trace exporter: %w", service, err)
	}
	// The service's own name last, so that it wins over OTEL_SERVICE_NAME:
	// one process may run all four.
	res, err := resource.New(ctx, resource.WithFromEnv(), resource.WithTelemetrySDK(),
		resource.WithAttributes(attribute.String("service.name", "shop-"+service)))
	if err != nil {
		return nil, fmt.Errorf("%s: trace resource: %w", service, err)
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}

// exportTraces gives each of services that has no tracer provider yet one
// that exports to cfg.TracesEndpoint, when it is set. The returned func
// shuts them down, flushing their spans; call it once the services have
// stopped.
func exportTraces(ctx context.Context, cfg Config, services []*Service) (func(), error) {
	var providers []*sdktrace.TracerProvider
	shutdown := func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), traceShutdownTimeout)
		defer cancel()
		for _, tp := range providers {
			_ = tp.Shutdown(ctx) // a collector that is away loses the last spans; nothing else to do
		}
	}
	if cfg.TracesEndpoint == "" {
		return shutdown, nil
	}
	for _, s := range services {
		if s.tracer != nil {
			continue
		}
		tp, err := newExportingTracerProvider(ctx, s.Name)
		if err != nil {
			shutdown()
			return nil, err
		}
		providers = append(providers, tp)
		s.tracer = tp
	}
	return shutdown, nil
}
