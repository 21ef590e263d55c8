package outbox

import (
	"log/slog"
	"testing"
)

// A Config without a Logger logs to slog.Default(), as pkg/inbox and
// pkg/saga do.
func TestLoggerDefaultsToSlogDefault(t *testing.T) {
	var c Config
	c.setDefaults()
	if c.Logger != slog.Default() {
		t.Fatalf("default Logger %v, want slog.Default()", c.Logger)
	}
}
