//go:build shopbench

package benchsuite

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// tracing is row 10: the whole saga with tracing off and on, run after run
// in turn so that both see the same machine. On, every service samples
// every span (OTEL_TRACES_SAMPLER=always_on) and exports it with the SDK's
// batch span processor over OTLP/HTTP to a local server that discards what
// it gets: the cost measured is making the spans, propagating traceparent
// through the outbox rows and the messages, encoding and sending them; not
// a collector's.
func tracing(b *testing.B, t *table, sz sizes) {
	var exports, exported atomic.Int64 // requests and bytes the sink got: proof that tracing was on
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		exports.Add(1)
		exported.Add(n)
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK) // an empty ExportTraceServiceResponse: all accepted
	}))
	defer sink.Close()
	on := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + sink.URL, "OTEL_TRACES_SAMPLER=always_on"}

	var results [2][]sagaResult
	var requests, kib []float64
	for range *runs {
		results[0] = append(results[0], saga(b, sz))
		exports.Store(0)
		exported.Store(0)
		results[1] = append(results[1], sagaWith(b, sz, on))
		if exports.Load() == 0 {
			// Nothing reached the sink: the "on" run made no spans, and the
			// row would compare tracing off with tracing off.
			b.Fatalf("tracing on: the shop exported no spans to %s", sink.URL)
		}
		requests, kib = append(requests, float64(exports.Load())), append(kib, float64(exported.Load())/1024)
	}
	secs := *sagaSeconds
	if *quick {
		secs = 4 // as saga() runs it
	}
	labels := []string{"tracing off", "tracing on, every span exported"}
	for i, label := range labels {
		var rate, p99, cpu, busy []float64
		for _, r := range results[i] {
			rate, p99, cpu, busy = append(rate, r.rate), append(p99, r.p99), append(cpu, r.cpuPerOrder), append(busy, r.busy)
		}
		t.add("10", fmt.Sprintf("whole saga, %d s at %g orders/s offered, %s: COMPLETED/s", secs, *sagaRate, label), "orders/s", rate)
		t.add("10", fmt.Sprintf("  order → COMPLETED p99 (%s)", label), "ms", p99)
		t.add("10", fmt.Sprintf("  machine CPU busy in the measured window (%s)", label), "%", busy)
		t.add("10", fmt.Sprintf("  machine CPU per completed order (%s)", label), "ms", cpu)
	}
	t.add("10", "  OTLP export requests received (tracing on)", "requests", requests)
	t.add("10", "  OTLP bytes received (tracing on)", "KiB", kib)
	row := func(what, label string) string {
		if what == "" {
			return fmt.Sprintf("whole saga, %d s at %g orders/s offered, %s: COMPLETED/s", secs, *sagaRate, label)
		}
		return fmt.Sprintf("  %s (%s)", what, label)
	}
	for _, what := range []string{"", "order → COMPLETED p99", "machine CPU per completed order"} {
		t.ratio(row(what, labels[1]), row(what, labels[0]), "of tracing off", "")
	}
}
