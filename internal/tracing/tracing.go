// Package tracing is where the spans of the shop's processes say they come
// from and how they leave: each service has its own tracer provider,
// passed down through its configuration (never the otel global one): in
// `shop all` the four services are four service.names in the trace, as
// four processes would be. The libraries only see a trace.TracerProvider,
// and nil means no spans.
package tracing

import (
	"context"
	"fmt"
	"net"
	"runtime/debug"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Resources returns what the spans of this process say about where
// they come from, for a trace UI: the resource of one service's spans,
// given its name. All of a process's services share the host and process
// attributes — host.name, host.id (where the machine has one), os.type,
// process.pid, the executable and Go runtime — and one service.instance.id
// drawn at start-up, so that two copies of a service are told apart. Each
// has service.name "shop-<service>", and service.version when the binary
// knows it (a module version, else its VCS revision).
//
// It adds "ip", the host's address, because that is Jaeger's key for "same
// host, same clock" in the API its UI reads (/api/traces; host.id and
// host.name serve only its newer /api/v3): without it Jaeger compares
// every asynchronous hop as if it crossed machines, and flags a consumer
// span that starts after its publish span ended as clock skew.
//
// The standard OTEL_RESOURCE_ATTRIBUTES (and OTEL_SERVICE_NAME) override
// any of them but service.name, which stays the service's own: one process
// may run all four.
func Resources(ctx context.Context) (func(service string) *resource.Resource, error) {
	// A detector that finds nothing leaves its attribute out rather than
	// stopping the process: most containers have no /etc/machine-id, and
	// their spans are no less useful for it.
	detected, _ := resource.New(ctx, resource.WithHost(), resource.WithHostID(), resource.WithOSType(),
		resource.WithProcessPID(), resource.WithProcessExecutableName(),
		resource.WithProcessRuntimeName(), resource.WithProcessRuntimeVersion(), resource.WithTelemetrySDK())
	own := []attribute.KeyValue{
		attribute.String("service.instance.id", uuid.NewString()),
		attribute.String("ip", hostIP()),
	}
	if v := buildVersion(); v != "" {
		own = append(own, attribute.String("service.version", v))
	}
	fromEnv, err := resource.New(ctx, resource.WithFromEnv())
	if err != nil { // a malformed OTEL_RESOURCE_ATTRIBUTES is the operator's to fix
		return nil, fmt.Errorf("trace resource: %w", err)
	}
	process, err := resource.Merge(detected, resource.NewSchemaless(own...))
	if err == nil {
		process, err = resource.Merge(process, fromEnv)
	}
	if err != nil {
		return nil, fmt.Errorf("trace resource: %w", err)
	}
	return func(service string) *resource.Resource {
		// Merging with a schemaless resource cannot conflict.
		r, _ := resource.Merge(process, resource.NewSchemaless(attribute.String("service.name", "shop-"+service)))
		return r
	}, nil
}

// hostIP is the host's address as Jaeger clients report it: the first
// IPv4 address of an interface that is up and not loopback, else the first
// such IPv6 one, else the loopback address (a machine with no network).
func hostIP() string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return "127.0.0.1"
	}
	var v6 string
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok || n.IP.IsLoopback() || n.IP.IsLinkLocalUnicast() {
			continue
		}
		if n.IP.To4() != nil {
			return n.IP.String()
		}
		if v6 == "" {
			v6 = n.IP.String()
		}
	}
	if v6 != "" {
		return v6
	}
	return "127.0.0.1"
}

// buildVersion is the binary's version when it knows one: the module's
// (go install …@v1.2.3), else the commit it was built from, "-dirty" when
// the tree had changes; "" for a build that recorded neither.
func buildVersion() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	if v := info.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev, dirty string
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "-dirty"
			}
		}
	}
	if rev == "" {
		return ""
	}
	return rev + dirty
}

// NewProvider returns a provider that exports over
// OTLP/HTTP, configured by the standard OTEL_* variables (endpoint,
// headers, timeout, sampler, batch processor), with res for resource. Its
// Shutdown flushes what is buffered.
func NewProvider(ctx context.Context, res *resource.Resource) (*sdktrace.TracerProvider, error) {
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("otlp trace exporter: %w", err)
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}
