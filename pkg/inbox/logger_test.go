package inbox

import (
	"log/slog"
	"testing"
)

// A Config without a Logger logs to slog.Default(), as pkg/outbox and
// pkg/saga do: the consumer's warnings are an operator's, not noise to drop.
func TestLoggerDefaultsToSlogDefault(t *testing.T) {
	var c Config
	c.setDefaults()
	if c.Logger != slog.Default() {
		t.Fatalf("default Logger %v, want slog.Default()", c.Logger)
	}
}
