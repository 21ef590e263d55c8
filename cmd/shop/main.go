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
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/reconcile"
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
  shop migrate [-roles] [service…]
                           apply the migrations of each service's schema (default: all), then exit;
                           -roles also creates each service's least-privilege database role
  shop verify [-wait 30s] [-repair] [-streams=false]
                           check the contract's invariants against the live schemas and
                           every service's stream on NATS_URL (each published event still
                           there); exit 0 when they hold, 1 with a report when not; -repair
                           first reconciles (stuck orders, unrefunded payments, held stock,
                           events a stream lost) and republishes lost events
  shop outbox <command>    operator commands: status, dead, show <event-id>, requeue <event-id>,
                           replay, republish --lost, dead-letters list|requeue|discard,
                           parked list|discard; "shop outbox -h" for details
  shop trace <order-id> [--json]
                           one order's journey: each event committed, published, processed by
                           each consumer, with the time each hop took; retries, dead and parked
                           messages; the saga's state changes
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
	case cmd == "trace":
		return runTrace(ctx, args, getenv, stdout, stderr)
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
		fmt.Fprintf(stderr, "Usage: shop %s [flags]%s\n\n", cmd, operands)
		if cmd == "migrate" {
			fmt.Fprint(stderr, migrateHelp)
		}
		fmt.Fprint(stderr, "Flags (each overrides the environment variable named beside it):\n")
		fs.PrintDefaults()
	}
	cfg.RegisterFlags(fs)
	// Each command's own flags exist only for it: `shop order -demo` is a
	// usage error, not a flag accepted and ignored.
	var (
		wait                         time.Duration
		repair, streams, demo, roles bool
	)
	switch cmd {
	case "verify":
		fs.DurationVar(&wait, "wait", 0, "keep checking up to this long until the invariants hold (events in flight settle)")
		fs.BoolVar(&repair, "repair", false, "first reconcile: report stuck orders, unrefunded payments, held reservations and events a stream lost, and republish the lost events")
		fs.BoolVar(&streams, "streams", true, "also audit every service's stream on the NATS server (NATS_URL; else a demo's embedded server running here; else "+app.DefaultNATSURL+") against its outbox; false checks the databases only and says so")
	case "all":
		fs.BoolVar(&demo, "demo", false, "stock a small catalogue and print curl commands to try")
	case "migrate":
		fs.BoolVar(&roles, "roles", false, "also create or update each service's database role shop_<service> (passwords from <SERVICE>_ROLE_PASSWORD or SHOP_ROLE_PASSWORD)")
	}
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
		return migrate(ctx, cfg, fs.Args(), roles, getenv, log)
	case "verify":
		return runVerify(ctx, cfg, wait, repair, streams, stdout)
	case "all":
		if fs.NArg() > 0 {
			fmt.Fprintf(stderr, "shop all: unexpected arguments %q\n", fs.Args())
			return errUsage
		}
		log.Info("starting", "services", app.Names, "config", cfg)
		if demo {
			return app.RunDemo(ctx, cfg, log, stdout)
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

// migrateHelp is the part of `shop migrate -h` that flags cannot say.
const migrateHelp = `Migrations run as the owner of the schemas: DATABASE_URL (or <SERVICE>_DATABASE_URL)
must name an administrative role here, never a service's role.

With -roles, after migrating, each named service gets a LOGIN role of its own,
shop_order, shop_inventory, shop_payment, shop_fulfillment, that may use its own
schema only: USAGE on it, SELECT/INSERT/UPDATE/DELETE on its tables, USAGE/SELECT
on its sequences, the same on tables later migrations add (default privileges);
no CREATE anywhere, nothing on the other services' schemas. Running it again is
safe: it re-grants and sets the password again. The passwords come from
ORDER_ROLE_PASSWORD, INVENTORY_ROLE_PASSWORD, PAYMENT_ROLE_PASSWORD and
FULFILLMENT_ROLE_PASSWORD, else SHOP_ROLE_PASSWORD for all (a demo); they are
sent as SCRAM verifiers and never logged. Then run each service with its role:
  ORDER_DATABASE_URL=postgres://shop_order:<password>@host:5432/shop shop order
A service started with its role does not migrate; it checks that nothing is pending.

`

// migrate applies the migrations of the named services (all when none is
// named), one after the other, then, with roles, creates their roles.
func migrate(ctx context.Context, cfg app.Config, names []string, roles bool, getenv func(string) string, log *slog.Logger) error {
	if len(names) == 0 {
		names = app.Names
	}
	for _, name := range names {
		if !slices.Contains(app.Names, name) {
			return fmt.Errorf("migrate: unknown service %q (want one of %v)", name, app.Names)
		}
	}
	passwords := map[string]string{}
	if roles { // every password first: fail before changing anything
		for _, name := range names {
			pw, err := app.RolePassword(getenv, name)
			if err != nil {
				return fmt.Errorf("migrate -roles: %w", err)
			}
			passwords[name] = pw
		}
	}
	for _, name := range names {
		if err := app.Migrate(ctx, cfg.DatabaseURLOf(name), name, log.With("service", name)); err != nil {
			return err
		}
	}
	if roles {
		for _, name := range names {
			err := app.CreateRole(ctx, cfg.DatabaseURLOf(name), name, app.RoleName(name), passwords[name], log.With("service", name))
			if err != nil {
				return fmt.Errorf("migrate -roles: %w", err)
			}
		}
	}
	return nil
}

// errViolations makes shop verify exit 1 after printing its report.
var errViolations = errors.New("invariants violated")

// runVerify checks the invariants and prints the report. With repair it
// first runs the reconciler once (internal/reconcile) and prints its
// findings; the exit status still tells only whether the invariants hold.
// With streams it audits each service's stream against its outbox on the
// NATS server of cfg (its default when unset, as a single service does); a
// server it cannot reach is a failed check in the report, not a pass.
func runVerify(ctx context.Context, cfg app.Config, wait time.Duration, repair, streams bool, stdout io.Writer) error {
	pools := map[string]*pgxpool.Pool{}
	for _, name := range app.Names {
		pool, err := database.NewPool(ctx, cfg.DatabaseURLOf(name), migrations.Schemas[name], 2)
		if err != nil {
			return err
		}
		defer pool.Close()
		pools[name] = pool
	}
	vp := verify.Pools{
		Order: pools["order"], Inventory: pools["inventory"], Payment: pools["payment"], Fulfillment: pools["fulfillment"],
	}
	var opts []verify.Option
	var js jetstream.JetStream
	var unreachable error
	natsURL := app.OperatorNATSURL(cfg)
	if streams {
		// As the read-only audit user (AUDIT_NATS_PASSWORD, or the demo's).
		nc, err := nats.Connect(natsURL, append(app.AuditConnectOptions(cfg), nats.Name("shop verify"), nats.Timeout(5*time.Second))...)
		if err == nil {
			defer nc.Close()
			js, err = jetstream.New(nc)
		}
		if err != nil {
			unreachable = fmt.Errorf("cannot reach NATS at %s: %w", app.MaskURL(natsURL), err)
		} else {
			opts = append(opts, verify.WithStreams(js))
		}
	}
	if repair {
		rcfg := app.ReconcileConfig(cfg)
		rcfg.JetStream = js // nil when the streams are not audited
		rep, err := reconcile.Run(ctx, vp, rcfg)
		if err != nil {
			return fmt.Errorf("verify -repair: %w", err)
		}
		rep.Write(stdout)
	}
	report, err := verify.Wait(ctx, vp, app.OutboxRetention, wait, opts...)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	switch {
	case !streams:
		fmt.Fprintln(stdout, "skip invariant 3: the streams were not audited against the outboxes (-streams=false)")
	case unreachable != nil:
		// Never a silent pass: the audit that could not run fails.
		report.Checks = append(report.Checks, verify.Check{Invariant: 3,
			Name:       "every stream holds every event marked published",
			Violations: []string{fmt.Sprintf("not audited: %v (-streams=false checks the databases only)", unreachable)}})
	}
	report.Write(stdout)
	if !report.OK() {
		return errViolations
	}
	return nil
}
