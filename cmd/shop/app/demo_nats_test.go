package app

import (
	"os"
	"testing"

	"github.com/shop-ref/shop/internal/config"
)

// The operator commands run beside a demo read the demo's embedded server,
// wherever it listens (4222 is often another server's), and fall back to
// NATS_URL's default once the demo has stopped.
func TestOperatorNATSURLFindsTheDemo(t *testing.T) {
	t.Chdir(t.TempDir())
	if got := OperatorNATSURL(""); got != config.DefaultNATSURL {
		t.Fatalf("no demo: %q, want %q", got, config.DefaultNATSURL)
	}
	if err := writeDemoNATS("nats://127.0.0.1:40123", "pw"); err != nil {
		t.Fatal(err)
	}
	if got := OperatorNATSURL(""); got != "nats://127.0.0.1:40123" {
		t.Fatalf("a demo running: %q", got)
	}
	if got := OperatorNATSURL("nats://10.0.0.1:4222"); got != "nats://10.0.0.1:4222" {
		t.Fatalf("NATS_URL set: %q", got)
	}
	if err := os.Remove(DemoNATSURLFile); err != nil {
		t.Fatal(err)
	}
	if got := OperatorNATSURL(""); got != config.DefaultNATSURL {
		t.Fatalf("the demo stopped: %q", got)
	}
}
