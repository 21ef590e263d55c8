package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/demo"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// The addresses the README's quick start is written for: the default
// ORDER_ADDR and PAYMENT_ADDR as the banner prints them. They are the only
// thing TestNewcomer changes in a README block, to the addresses its own
// demo bound (a test must not use the default ports: a demo may run there).
const (
	readmeOrderURL   = "http://127.0.0.1:8081"
	readmePaymentURL = "http://127.0.0.1:8083"
)

// TestNewcomer does what a newcomer does on a fresh clone: start `shop all
// -demo`, then paste the banner's blocks, and the README quick start's, in
// order into sh (dash) and into bash. Each paste must end with the order
// COMPLETED, every run a new order (a key that is not unique would
// silently return the first one), and the start-up log must say what the
// demo turned on. The banner's blocks are run as printed;
// the README's with only the two base URLs changed to the demo's.
func TestNewcomer(t *testing.T) {
	t.Parallel()
	readme := quickStartBlock(t)
	if want := dedent(demo.Commands(readmeOrderURL, readmePaymentURL)); readme != want {
		t.Errorf("the README's quick start shows other commands than the banner prints:\n%s\nwant:\n%s", readme, want)
	}

	vars := map[string]string{"DATABASE_URL": shoptest.NewDatabaseURL(t), "NATS_URL": natstest.New(t).URL(), "DASHBOARD_ADDR": "127.0.0.1:0"}
	for _, name := range services.All.Names() {
		vars[strings.ToUpper(name)+"_ADDR"] = "127.0.0.1:0"
	}
	var out, logs logbuf.Buffer
	startDemo(t, vars, &out, &logs)
	// The start-up log tells what runs: it said payment_fake_provider=false,
	// then warned that the fake provider was on.
	starting := regexp.MustCompile(`(?m)^.*msg=starting .*$`).FindString(logs.String())
	if !strings.Contains(starting, "payment_fake_provider=true") {
		t.Errorf("the start-up log does not say the demo's fake provider is on:\n%s", starting)
	}
	banner := out.String()
	_, blocks, _ := strings.Cut(banner, "pasting each block in order:\n")
	blocks, _, _ = strings.Cut(blocks, "\nOr watch and click")
	blocks = dedent(blocks)
	order := regexp.MustCompile(`http://127\.0\.0\.1:\d+/orders`).FindString(blocks)
	payment := regexp.MustCompile(`http://127\.0\.0\.1:\d+/payments`).FindString(blocks)
	if order == "" || payment == "" {
		t.Fatalf("no order or payment URL in the banner's blocks:\n%s", banner)
	}
	readme = strings.NewReplacer(readmeOrderURL+"/", strings.TrimSuffix(order, "orders"),
		readmePaymentURL+"/", strings.TrimSuffix(payment, "payments")).Replace(readme)

	orders := map[string]string{}
	for _, tc := range []struct{ name, script string }{
		{"banner", blocks}, {"README", readme},
	} {
		for _, shell := range []string{"sh", "bash"} {
			t.Run(tc.name+" in "+shell, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
				defer cancel()
				// Read from stdin, as a paste is: line by line, in one shell.
				cmd := exec.CommandContext(ctx, shell, "-s")
				cmd.Stdin = strings.NewReader(tc.script)
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				if err := cmd.Run(); err != nil {
					t.Fatalf("%s: %v\nstdout:\n%s\nstderr:\n%s", shell, err, &stdout, &stderr)
				}
				got := stdout.String()
				m := regexp.MustCompile(`order ([0-9a-f-]{36})\n`).FindStringSubmatch(got)
				if m == nil {
					t.Fatalf("step 1 printed no order id:\n%s\nstderr:\n%s", got, &stderr)
				}
				if prev, ok := orders[m[1]]; ok {
					t.Errorf("the same order %s as the %s run: the Idempotency-Key is not unique per run", m[1], prev)
				}
				orders[m[1]] = tc.name + " in " + shell
				if strings.Contains(got, "not-payable") || !strings.Contains(got, `"status"`) {
					t.Errorf("step 2's payment was not accepted:\n%s", got)
				}
				lines := strings.Split(strings.TrimSpace(got), "\n")
				if last := lines[len(lines)-1]; last != "COMPLETED" {
					t.Errorf("step 3 ended with %q, want COMPLETED:\n%s\nstderr:\n%s", last, got, &stderr)
				}
			})
		}
	}
}

// quickStartBlock is the README's quick-start block that places an order:
// the ```sh block of "## Quick start" that sends an Idempotency-Key.
func quickStartBlock(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(b), "\n## Quick start\n")
	section, _, _ = strings.Cut(section, "\n## ")
	for _, block := range strings.Split(section, "```sh\n")[1:] {
		block, _, _ = strings.Cut(block, "```")
		if strings.Contains(block, "Idempotency-Key") {
			return block
		}
	}
	t.Fatal("the README's quick start has no ```sh block that places an order")
	return ""
}

// dedent removes the banner's two-space indent.
func dedent(s string) string {
	lines := strings.Split(strings.Trim(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimPrefix(l, "  ")
	}
	return strings.Join(lines, "\n") + "\n"
}

// TestREADMECommandsNameBinShop: the README runs the binary make builds: bin/shop, not ./shop or a
// bare shop that a newcomer's PATH does not have.
// startDemo runs `shop all -demo` with vars as its environment until the
// test ends, writing to out and logs, and waits for its banner, as a
// newcomer waits for the lines to paste.
func startDemo(t *testing.T, vars map[string]string, out, logs io.Writer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"all", "-demo"}, env(vars), out, logs) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	printed := out.(interface{ String() string })
	poll.Until(t, time.Minute, "the demo banner", func() bool {
		select {
		case err := <-done:
			done <- err // for the cleanup
			t.Fatalf("shop all -demo returned: %v", err)
		default:
		}
		return strings.Contains(printed.String(), "Or watch and click")
	})
}

func TestREADMECommandsNameBinShop(t *testing.T) {
	t.Parallel()
	// The README and the operating guide it sends its readers to.
	var b []byte
	for _, name := range []string{"../../README.md", "../../docs/operating.md"} {
		page, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		b = append(b, page...)
	}
	wrong := regexp.MustCompile(`(^|[\s;&|(=])(\./shop|shop) (all|order|inventory|payment|fulfillment|migrate|verify|outbox|trace|loadgen|dashboard)\b`)
	for i, block := range strings.Split(string(b), "```sh\n")[1:] {
		block, _, _ = strings.Cut(block, "```")
		for _, line := range strings.Split(block, "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "#") {
				continue
			}
			if m := wrong.FindString(line); m != "" {
				t.Errorf("README sh block %d runs %q, but make builds bin/shop: %s", i+1, strings.TrimSpace(m), line)
			}
		}
	}
}
