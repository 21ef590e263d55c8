// Command shop is the one binary of the shop: every service, alone or all in
// one process, and the operator commands. Run `shop -h` for the list.
//
// main only dispatches: each command is a function with its own flag set
// (the services in serve.go, the operator commands in cmd/shop/operator,
// the load generator in ops/loadgen), and its error chooses the exit
// status.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/shop-ref/shop/cmd/shop/operator"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/ops/loadgen"
	"github.com/shop-ref/shop/services"
)

// usage is the help of shop; its services are the registry's (services.All),
// so that a new service's command is listed without an edit here.
var usage = strings.NewReplacer(
	"{services}", strings.Join(services.All.Names(), " | "),
	"{list}", strings.Join(services.All.Names(), ", "),
).Replace(`shop: a teaching-reference e-commerce system ({list})
built on a transactional outbox, idempotent consumers and JetStream.

Usage:
  shop all [-demo]         every service in one process; -demo stocks a catalogue and prints curls;
                           a live dashboard on DASHBOARD_ADDR (default 127.0.0.1:8080)
  shop {services}
                           one service: HTTP, its consumers and its outbox relay
  shop dashboard           the live dashboard alone, on DASHBOARD_ADDR: reads the services'
                           schemas, shows each service's /readyz from its <SERVICE>_URL; with
                           DASHBOARD_DEMO=true places and pays orders through ORDER_URL and PAYMENT_URL
  shop migrate [-roles] [service…]
                           apply the migrations of each service's schema (default: all), then exit;
                           -roles also creates each service's least-privilege database role
  shop verify [-wait 30s] [-repair] [-streams=false]
                           check the contract's invariants against the live schemas and
                           every service's stream on NATS_URL (each published event still
                           there); exit 0 when they hold, 1 with a report when not, 1 and one
                           line when there is no shop there (no schemas, not its NATS); -repair
                           first reconciles (stuck orders, unrefunded payments, held stock,
                           events a stream lost) and republishes lost events
  shop outbox <command>    operator commands: status, dead, show <event-id>, requeue <event-id>,
                           replay, republish --lost, dead-letters list|requeue|discard,
                           parked list|discard; "shop outbox -h" for details
  shop slots list|drop [--service S] [-force]
                           the replication slots and publications of the services' outboxes
                           (cdc mode makes them): list them, with the WAL each holds; drop
                           them before switching a service to poll or lowering wal_level
                           (Postgres will not start with a logical slot and wal_level=replica);
                           a slot a relay streams is dropped only with -force
  shop trace <order-id> [--json]
                           one order's journey: each event committed, published, processed by
                           each consumer, with the time each hop took; retries, dead and parked
                           messages; the saga's state changes
  shop loadgen [-orders N] drive orders through the public HTTP API (local targets only),
                           then print throughput and latency percentiles

Configuration comes from the environment: DATABASE_URL, <SERVICE>_DATABASE_URL
(ORDER_DATABASE_URL, …), NATS_URL, <SERVICE>_ADDR and <SERVICE>_NATS_PASSWORD,
DASHBOARD_ADDR, DASHBOARD_DEMO, DASHBOARD_HOSTS and <SERVICE>_URL (shop dashboard).
SHOP_FAILPOINTS (testing only) arms crash points, e.g. outbox.after_claim=crash@3.
Flags override it; "shop <command> -h" lists them.
`)

// command runs one command line of shop, after the command's name. The
// environment comes in through getenv so that tests need not change the
// process's.
type command func(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error

// commands is every command of shop by name: one per service
// (services.All), all of them at once, and the operator's.
func commands() map[string]command {
	// The one place that wires the shop's services: every other package
	// gets them from here (services/imports_test.go holds the rule).
	reg := services.All
	op := operator.Shop{Services: reg}
	cmds := map[string]command{
		"all":       serveAll(reg),
		"dashboard": serveDashboard(reg),
		"migrate":   op.Migrate,
		"verify":    op.Verify,
		"outbox":    op.Outbox,
		"slots":     op.Slots,
		"trace":     op.Trace,
		"loadgen":   loadgen.Command{Services: reg}.Run,
	}
	for _, name := range reg.Names() {
		cmds[name] = serveOne(reg, name)
	}
	return cmds
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	warnUnknownServices(os.Environ(), os.Stderr)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(exitCode(err, os.Stderr))
}

// warnUnknownServices warns of each variable of environ that configures a
// service shop does not have (config.UnknownServiceVars): a service whose
// package is left out of services.All is otherwise absent without a word.
// A warning, not an error: the variable may be meant for another program.
func warnUnknownServices(environ []string, stderr io.Writer) {
	log := slog.New(slog.NewTextHandler(stderr, nil))
	for _, u := range config.UnknownServiceVars(services.All, environ) {
		log.Warn("a variable configures a service this shop does not have: if "+u.Service+" is a service, "+
			"add the line `"+u.Service+".Registration,` to All in services/services.go, with its import (docs/adding-a-service.md); "+
			"otherwise unset it", "var", u.Var, "service", u.Service, "services", services.All.Names())
	}
}

// exitCode is the exit status of a command that returned err: 0 on success
// or -h, 2 for a usage mistake, 1 for any other failure. A failure that has
// not said so yet (any but the usage errors and verify's report) is
// printed to stderr.
func exitCode(err error, stderr io.Writer) int {
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, cli.ErrUsage):
		return 2
	case errors.Is(err, operator.ErrViolations):
		return 1
	}
	fmt.Fprintln(stderr, "shop:", err)
	return 1
}

// run executes one command line.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return cli.ErrUsage
	}
	name, args := args[0], args[1:]
	switch name {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	cmd, ok := commands()[name]
	if !ok {
		fmt.Fprintf(stderr, "shop: unknown command %q\n\n%s", name, usage)
		return cli.ErrUsage
	}
	// A service package the registry leaves out would run nowhere, without
	// a word: every command refuses to start instead, naming the line.
	if err := services.Unlisted(); err != nil {
		return err
	}
	return cmd(ctx, args, getenv, stdout, stderr)
}
