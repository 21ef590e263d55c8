// Command shop is the one binary of the shop: every service, alone or all in
// one process, and the operator commands. Run `shop -h` for the list.
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
	"slices"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/migrations"
)

const usage = `shop: a teaching-reference e-commerce system (order, inventory, payment,
fulfillment) built on a transactional outbox, idempotent consumers and JetStream.

Usage:
  shop all [-demo]         every service in one process; -demo stocks a catalogue and prints curls;
                           a live dashboard on DASHBOARD_ADDR (default :8080)
  shop order | inventory | payment | fulfillment
                           one service: HTTP, its consumers and its outbox relay
  shop migrate [service…]  apply the migrations of each service's schema (default: all), then exit
  shop verify [-wait 30s]  check the contract's invariants against the live schemas;
                           exit 0 when they hold, 1 with a report when not
  shop outbox <command>    operator commands: status, show <event-id>, requeue <event-id>,
                           replay, dead-letters list|requeue; "shop outbox -h" for details
  shop loadgen [-orders N] drive orders through the public HTTP API (local targets only),
                           then print throughput and latency percentiles

Configuration comes from the environment: DATABASE_URL, ORDER_DATABASE_URL (and
INVENTORY_, PAYMENT_, FULFILLMENT_), NATS_URL, ORDER_ADDR (and the others).
SHOP_FAILPOINTS (testing only) arms crash points, e.g. outbox.after_claim=crash@3.
Flags override it; "shop <command> -h" lists them.
`

// errUsage marks a command line shop does not understand.
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		os.Exit(2)
	case errors.Is(err, errViolations):
		os.Exit(1)
	default:
		fmt.Fprintln(os.Stderr, "shop:", err)
		os.Exit(1)
	}
}

// run executes one command line. The environment comes in through getenv so
// that tests need not change the process's.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errUsage
	}
	cmd, args := args[0], args[1:]
	switch {
	case cmd == "-h" || cmd == "-help" || cmd == "--help" || cmd == "help":
		fmt.Fprint(stdout, usage)
		return nil
	case cmd == "outbox":
		return runOutbox(ctx, args, getenv, stdout, stderr)
	case cmd == "loadgen":
		return runLoadgen(ctx, args, getenv, stdout, stderr)
	case cmd != "all" && cmd != "migrate" && cmd != "verify" && !slices.Contains(app.Names, cmd):
		fmt.Fprintf(stderr, "shop: unknown command %q\n\n%s", cmd, usage)
		return errUsage
	}

	cfg, err := app.LoadConfig(getenv)
	if err != nil {
		return err
	}
	fs := flag.NewFlagSet("shop "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		operands := ""
		if cmd == "migrate" {
			operands = " [service…]"
		}
		fmt.Fprintf(stderr, "Usage: shop %s [flags]%s\n\nFlags (each overrides the environment variable named beside it):\n", cmd, operands)
		fs.PrintDefaults()
	}
	cfg.RegisterFlags(fs)
	wait := fs.Duration("wait", 0, "verify: keep checking up to this long until the invariants hold (events in flight settle)")
	demo := fs.Bool("demo", false, "all: stock a small catalogue and print curl commands to try")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage // the flag package has said what was wrong
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	if cmd != "migrate" && cmd != "verify" {
		// The failpoints are armed once, here, from SHOP_FAILPOINTS; a
		// name that no failpoint has stops the start-up.
		if err := failpoint.Init(getenv); err != nil {
			return err
		}
		if spec := failpoint.Spec(); spec != "" {
			log.Warn("failpoints armed: this process will fail or crash on purpose", "SHOP_FAILPOINTS", spec)
		}
	}

	switch cmd {
	case "migrate":
		return migrate(ctx, cfg, fs.Args(), log)
	case "verify":
		return runVerify(ctx, cfg, *wait, stdout)
	case "all":
		if fs.NArg() > 0 {
			fmt.Fprintf(stderr, "shop all: unexpected arguments %q\n", fs.Args())
			return errUsage
		}
		log.Info("starting", "services", app.Names, "config", cfg)
		if *demo {
			go func() {
				if err := app.SeedDemo(ctx, cfg, stdout); err != nil && ctx.Err() == nil {
					log.Error("demo seed failed", "err", err)
				}
			}()
		}
		return app.Run(ctx, cfg, app.Names, log)
	default:
		if fs.NArg() > 0 {
			fmt.Fprintf(stderr, "shop %s: unexpected arguments %q\n", cmd, fs.Args())
			return errUsage
		}
		if cfg.NATSURL == "" { // only `shop all` embeds a server
			cfg.NATSURL = app.DefaultNATSURL
		}
		log.Info("starting", "services", []string{cmd}, "config", cfg)
		return app.Run(ctx, cfg, []string{cmd}, log)
	}
}

// migrate applies the migrations of the named services (all when none is
// named), one after the other, and returns.
func migrate(ctx context.Context, cfg app.Config, names []string, log *slog.Logger) error {
	if len(names) == 0 {
		names = app.Names
	}
	for _, name := range names {
		if !slices.Contains(app.Names, name) {
			return fmt.Errorf("migrate: unknown service %q (want one of %v)", name, app.Names)
		}
	}
	for _, name := range names {
		if err := app.Migrate(ctx, cfg.DatabaseURLOf(name), name, log.With("service", name)); err != nil {
			return err
		}
	}
	return nil
}

// errViolations makes shop verify exit 1 after printing its report.
var errViolations = errors.New("invariants violated")

// runVerify checks the invariants and prints the report.
func runVerify(ctx context.Context, cfg app.Config, wait time.Duration, stdout io.Writer) error {
	pools := map[string]*pgxpool.Pool{}
	for _, name := range app.Names {
		pool, err := database.NewPool(ctx, cfg.DatabaseURLOf(name), migrations.Schemas[name], 2)
		if err != nil {
			return err
		}
		defer pool.Close()
		pools[name] = pool
	}
	report, err := verify.Wait(ctx, verify.Pools{
		Order: pools["order"], Inventory: pools["inventory"], Payment: pools["payment"], Fulfillment: pools["fulfillment"],
	}, app.OutboxRetention, wait)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	report.Write(stdout)
	if !report.OK() {
		return errViolations
	}
	return nil
}
