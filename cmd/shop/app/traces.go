package app

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/tracing"
)

// traceShutdownTimeout bounds the flush of the spans still buffered when
// the process stops.
const traceShutdownTimeout = 5 * time.Second

// exportTraces gives each of services that has no tracer provider yet one
// that exports to cfg.TracesEndpoint, when it is set. The returned func
// shuts them down, flushing their spans; call it once the services have
// stopped. A failed export (a collector that is away) is logged to log.
func exportTraces(ctx context.Context, cfg config.Config, services []*Service, log *slog.Logger) (func(), error) {
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
	tracing.LogErrors(log)
	resourceOf, err := tracing.Resources(ctx)
	if err != nil {
		return nil, err
	}
	for _, s := range services {
		if s.tracer != nil {
			continue
		}
		tp, err := tracing.NewProvider(ctx, resourceOf(s.Name))
		if err != nil {
			shutdown()
			return nil, fmt.Errorf("%s: %w", s.Name, err)
		}
		providers = append(providers, tp)
		s.tracer = tp
	}
	return shutdown, nil
}
