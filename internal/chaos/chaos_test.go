package chaos

import (
	"flag"
	"os"
	"testing"
	"time"
)

var (
	duration = flag.Duration("chaos.duration", 75*time.Second,
		"how long the chaos lasts (the short run of `go test ./...` by default; at least "+RetentionWait.String()+" so that retention runs)")
	rate = flag.Float64("chaos.rate", 3, "orders started per second during the chaos")
)

// TestChaos is the chaos run. By default it is the short run (about two
// minutes) that `make test` includes; `make chaos DURATION=5m` runs it long.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos run takes minutes; not with -short")
	}
	d := *duration
	if d < RetentionWait+5*time.Second {
		t.Fatalf("-chaos.duration %v: want at least %v (retention runs once a minute)", d, RetentionWait+5*time.Second)
	}
	Run(t, Config{Duration: d, Rate: *rate, Copies: 2, Out: os.Stdout})
}
