package tracing

import (
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
)

// errorLogEvery is how often a failing exporter is logged: the batch
// processor fails an export every few seconds for as long as the collector
// is away, and one line a minute (with how many failures it stands for)
// says so without burying the rest of the log.
const errorLogEvery = time.Minute

// LogErrors routes OpenTelemetry's errors into log. OpenTelemetry reports a
// failed export (a collector that is away or refuses spans) through its one
// process-wide error handler, whose default prints a plain
// "traces export: …" line to stderr, outside the structured log that
// operators filter and alert on; this handler writes them as warnings
// there instead. The handler is otel's global, so the last call wins;
// every process calls it once, with its root logger.
func LogErrors(log *slog.Logger) {
	otel.SetErrorHandler(NewErrorLogger(log, errorLogEvery, time.Now))
}

// ErrorLogger is an otel.ErrorHandler that logs to a slog.Logger: the first
// error at once, then at most one line per interval, counting the errors
// it did not log.
type ErrorLogger struct {
	log   *slog.Logger
	every time.Duration
	now   func() time.Time

	mu         sync.Mutex
	last       time.Time // when an error was last logged; zero: never
	suppressed int       // errors since then that were not logged
}

// NewErrorLogger returns an ErrorLogger that logs to log at most once per
// every, reading the time from now.
func NewErrorLogger(log *slog.Logger, every time.Duration, now func() time.Time) *ErrorLogger {
	return &ErrorLogger{log: log, every: every, now: now}
}

// Handle implements otel.ErrorHandler.
func (h *ErrorLogger) Handle(err error) {
	h.mu.Lock()
	now := h.now()
	if !h.last.IsZero() && now.Sub(h.last) < h.every {
		h.suppressed++
		h.mu.Unlock()
		return
	}
	notLogged := h.suppressed
	h.last, h.suppressed = now, 0
	h.mu.Unlock()
	h.log.Warn("opentelemetry: spans not exported (they are dropped; the services run on)",
		"err", err, "errors_not_logged_since_last", notLogged)
}
