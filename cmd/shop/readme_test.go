package main

import (
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// readmeBlock is the first ```sh block of the README after heading.
func readmeBlock(t *testing.T, heading string) string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n"+heading+"\n")
	_, rest, ok2 := strings.Cut(rest, "```sh\n")
	block, _, ok3 := strings.Cut(rest, "```")
	if !ok || !ok2 || !ok3 {
		t.Fatalf("README.md has no sh block under %q", heading)
	}
	return block
}

// TestReadmeTryItByHand runs the README's "Try it by hand" block line by
// line in sh and in bash against `shop all -demo`, as a newcomer would.
// Only what the README says to fill in is substituted: the default
// addresses localhost:8081…8084 by the ones the demo bound (the test's
// ports are random), <order_id> by the order the block's POST placed, and
// bin/shop by the binary built from this tree.
//
// Not parallel: it runs a whole shop, and beside this package's other
// whole shops it would pass Postgres's 100 connections.
func TestReadmeTryItByHand(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "shop")
	// The binary has the registry this test has.
	if out, err := exec.Command("go", "build", "-tags", services.BuildTags, "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	vars := map[string]string{"DATABASE_URL": shoptest.NewDatabaseURL(t), "NATS_URL": natstest.New(t).URL(),
		"DASHBOARD_ADDR": "127.0.0.1:0", "FULFILLMENT_DELAY": "500ms"}
	// A service the README's block calls gets a free port chosen here, to
	// put in the block; every other binds port 0, which no other process
	// can take between the choice and the bind.
	readme := readmeBlock(t, "## Try it by hand")
	var replace []string
	for _, e := range services.All {
		v := strings.ToUpper(e.Name) + "_ADDR"
		vars[v] = "127.0.0.1:0"
		if strings.Contains(readme, "localhost"+e.Addr) {
			vars[v] = shoptest.FreeAddr(t)
			replace = append(replace, "localhost"+e.Addr, vars[v])
		}
	}
	startDemo(t, vars, &logbuf.Buffer{}, io.Discard)
	ctx := t.Context()
	block := strings.NewReplacer(append(replace, "bin/shop", bin)...).Replace(readme)
	// One command a line: a line ending in \ goes on.
	var cmds []string
	var cur string
	for _, l := range strings.Split(block, "\n") {
		if strings.TrimSpace(l) == "" {
			continue
		}
		cur += l + "\n"
		if !strings.HasSuffix(strings.TrimSpace(l), "\\") {
			cmds = append(cmds, cur)
			cur = ""
		}
	}
	uuid := regexp.MustCompile(`"order_id":"([0-9a-f-]{36})"`)
	shellEnv := append(os.Environ(), "DATABASE_URL="+vars["DATABASE_URL"], "NATS_URL="+vars["NATS_URL"], "OPERATOR_TOKEN=")
	for _, shell := range []string{"sh", "bash"} {
		var order string
		for _, c := range cmds {
			if strings.Contains(c, "<order_id>") {
				if order == "" {
					t.Fatalf("%s: no order placed before %q", shell, c)
				}
				c = strings.ReplaceAll(c, "<order_id>", order)
			}
			// Each run places its own order: the README's key k-1 would
			// return the first run's.
			c = strings.ReplaceAll(c, "Idempotency-Key: k-1", "Idempotency-Key: k-"+shell)
			cctx, ccancel := context.WithTimeout(ctx, time.Minute)
			cmd := exec.CommandContext(cctx, shell, "-c", c)
			cmd.Env = shellEnv
			got, err := cmd.CombinedOutput()
			ccancel()
			if err != nil {
				t.Errorf("%s: %s failed: %v\n%s", shell, strings.TrimSpace(c), err, got)
			}
			if m := uuid.FindStringSubmatch(string(got)); m != nil && order == "" {
				order = m[1]
			}
		}
	}
}
