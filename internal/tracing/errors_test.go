package tracing

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/resource"

	"github.com/shop-ref/shop/proof/logbuf"
)

// A process exporting to a collector that is not there: the failed exports
// reach the structured log, as JSON records at WARN with the error, not as
// plain lines on stderr.
func TestExportErrorsReachTheStructuredLog(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := ln.Addr().String()
	ln.Close() // nothing listens there now: every export is refused
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+refused)
	t.Setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "200") // ms, retries included
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "20")     // ms between exports

	var out logbuf.Buffer
	LogErrors(slog.New(slog.NewJSONHandler(&out, nil)))
	tp, err := NewProvider(context.Background(), resource.Empty())
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = tp.Shutdown(ctx)
	}()
	_, span := tp.Tracer("test").Start(context.Background(), "lost")
	span.End()

	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), refused) {
		if time.Now().After(deadline) {
			t.Fatalf("no failed export in the structured log after 30s; it has:\n%s", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	line, _, _ := strings.Cut(out.String(), "\n")
	for _, want := range []string{`"level":"WARN"`, `"msg":"opentelemetry: spans not exported`, `"err":"traces export: `} {
		if !strings.Contains(line, want) {
			t.Errorf("log record %s lacks %s", line, want)
		}
	}
}

// A collector away for long: the first error is logged at once, then one
// line per interval saying how many it stands for.
func TestErrorLoggerLogsOncePerInterval(t *testing.T) {
	var out logbuf.Buffer
	now := time.Date(2026, 12, 5, 20, 0, 0, 0, time.UTC)
	h := NewErrorLogger(slog.New(slog.NewJSONHandler(&out, nil)), time.Minute, func() time.Time { return now })
	fail := errors.New("traces export: connection refused")

	h.Handle(fail) // logged
	for range 11 {
		now = now.Add(5 * time.Second)
		h.Handle(fail) // within the minute: counted only
	}
	now = now.Add(5 * time.Second)
	h.Handle(fail) // a minute after the first: logged, with the 11 before it

	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d log lines, want 2:\n%s", len(lines), out.String())
	}
	if !strings.Contains(lines[0], `"errors_not_logged_since_last":0`) || !strings.Contains(lines[1], `"errors_not_logged_since_last":11`) {
		t.Errorf("counts wrong:\n%s", out.String())
	}
}
