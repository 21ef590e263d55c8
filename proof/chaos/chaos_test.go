package chaos

import (
	"flag"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shop-ref/shop/services"
)

var (
	duration = flag.Duration("chaos.duration", 90*time.Second,
		"how long the chaos lasts (the short run of `go test ./...` by default; at least "+RetentionWait.String()+" so that retention runs)")
	rate   = flag.Float64("chaos.rate", 3, "orders started per second during the chaos")
	logDir = flag.String("chaos.logs", "", "keep the processes' logs (and the NATS stores) in this directory; empty: a temporary one, removed at the end")
	lanes  = flag.String("chaos.lanes", strings.Join(Lanes, ","), "the fault lanes that run, comma-separated: one alone measures its faults' stalls with nothing overlapping them; "+
		"cdc (not by default) runs every relay in ModeCDC on a private Postgres, killing streaming relays, dropping slots and restarting Postgres")
	nodes = flag.Int("chaos.nodes", 3, "NATS nodes: 3 (a cluster with R3 streams and every broker fault) or 1 (one node: outages, partitions, JetStream off, a consumer deleted)")
)

// TestChaos is the chaos run. By default it is the short run (90s of
// chaos, about two minutes in all, every broker fault once) that `make
// test` includes; `make chaos DURATION=5m` runs it long.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos run takes minutes; not with -short")
	}
	d := *duration
	if d < RetentionWait+5*time.Second {
		t.Fatalf("-chaos.duration %v: want at least %v (retention runs once a minute)", d, RetentionWait+5*time.Second)
	}
	if *nodes != 1 && *nodes != 3 {
		t.Fatalf("-chaos.nodes %d: want 3 or 1", *nodes)
	}
	var ls []string
	for _, l := range strings.Split(*lanes, ",") {
		if !slices.Contains(Lanes, l) && !slices.Contains(OptInLanes, l) {
			t.Fatalf("-chaos.lanes: unknown lane %q (want some of %v)", l, append(slices.Clone(Lanes), OptInLanes...))
		}
		ls = append(ls, l)
	}
	Run(t, Config{Services: services.All, BuildTags: services.BuildTags, Duration: d, Rate: *rate, Copies: 2, Nodes: *nodes, Out: os.Stdout, LogDir: *logDir, Lanes: ls})
}
