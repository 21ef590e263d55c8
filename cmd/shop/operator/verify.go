package operator

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/ops/reconcile"
	"github.com/shop-ref/shop/ops/verify"
)

// ErrViolations is what Verify returns when an invariant does not hold,
// after printing its report: shop exits 1 and prints nothing more.
var ErrViolations = errors.New("invariants violated")

// ErrNoShop is what Verify returns when there is no shop to verify where
// it looks: none of the services' schemas on DATABASE_URL, or a NATS
// server that is not the shop's (unreachable, the audit user unknown, none
// of the shop's streams), as after the demo stopped, with the machine's
// own NATS on 4222. Its one line says so; checks run against nothing
// would print FAIL lines that read like broken data.
var ErrNoShop = errors.New("no shop to verify")

// findTheDemo is how an operator command finds a demo whose embedded
// server took a free port (4222 was taken): the demo writes its address
// under the directory it runs in, not in one place per machine, where two
// demos (parallel tests) would overwrite each other's.
var findTheDemo = "a demo writes its address to " + app.DemoNATSURLFile +
	" where it runs: run this in the directory you ran `make demo` in, or set NATS_URL to the address the demo logged"

// Verify is `shop verify [-wait D] [-repair] [-streams=false]`: it checks
// the contract's invariants and prints the report. With -repair it first
// runs the reconciler once (ops/reconcile) and prints its findings;
// the result still tells only whether the invariants hold. With -streams
// (the default) it audits each service's stream against its outbox on the
// NATS server of the configuration (its default when unset, as a single
// service does). Where there is no shop (ErrNoShop: a schema missing, a
// NATS server it cannot reach or log in to as the audit user, or one with
// none of the shop's streams) it says so in one line and exits 1: never a
// pass, and no report of checks that had nothing to read.
func (s Shop) Verify(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cfg, err := loadVerifyConfig(s.Services, getenv)
	if err != nil {
		return err
	}
	var (
		wait            time.Duration
		repair, streams bool
	)
	fs := cli.ConfigFlags("shop verify", "", "", &cfg, stderr)
	fs.DurationVar(&wait, "wait", 0, "keep checking up to this long until the invariants hold (events in flight settle)")
	fs.BoolVar(&repair, "repair", false, "first reconcile: report stuck orders, unrefunded payments, held reservations and events a stream lost, and republish the lost events")
	fs.BoolVar(&streams, "streams", true, "also audit every service's stream on the NATS server (NATS_URL; else a demo's embedded server running here; else "+config.DefaultNATSURL+") against its outbox; false checks the databases only and says so")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}

	vp, closePools, err := app.OpenShop(ctx, cfg.schemas, 2)
	if err != nil {
		return err
	}
	defer closePools()
	if err := schemasExist(ctx, vp); err != nil {
		return err
	}
	var opts []verify.Option
	var js jetstream.JetStream
	natsURL := app.OperatorNATSURL(cfg.natsURL)
	if streams {
		// As the read-only audit user (AUDIT_NATS_PASSWORD, or the demo's).
		nc, err := nats.Connect(natsURL, append(app.AuditConnectOptions(cfg.auditPassword), nats.Name("shop verify"), nats.Timeout(5*time.Second))...)
		if err == nil {
			defer nc.Close()
			js, err = jetstream.New(nc)
		}
		if err != nil {
			return fmt.Errorf("%w: cannot reach NATS at %s as the shop's audit user (%v); %s; "+
				"-streams=false checks the databases only", ErrNoShop, config.MaskURL(natsURL), err, findTheDemo)
		}
		if err := streamsExist(ctx, js, s.Services, natsURL); err != nil {
			return err
		}
		opts = append(opts, verify.WithStreams(js))
	}
	if repair {
		rcfg := app.ReconcileConfig(cfg.settings)
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
	if !streams {
		fmt.Fprintln(stdout, "skip invariant 3: the streams were not audited against the outboxes (-streams=false)")
	}
	report.Write(stdout)
	if !report.OK() {
		return ErrViolations
	}
	return nil
}

// verifyConfig is what shop verify needs of the shop's configuration, and
// nothing more: where the schemas are, how to read the streams as the
// audit user, and the services' settings that -repair reads (the saga's
// timeouts).
type verifyConfig struct {
	schemas       config.Schemas
	natsURL       string // NATS_URL; empty: app.OperatorNATSURL finds the server
	auditPassword string // AUDIT_NATS_PASSWORD; empty: a local demo's, else anonymous
	settings      *registry.Env
}

func loadVerifyConfig(reg registry.Registry, getenv func(string) string) (verifyConfig, error) {
	schemas, err := config.LoadSchemas(reg, getenv)
	if err != nil {
		return verifyConfig{}, err
	}
	settings, err := config.LoadSettings(reg, getenv)
	if err != nil {
		return verifyConfig{}, err
	}
	return verifyConfig{schemas: schemas, natsURL: getenv("NATS_URL"),
		auditPassword: getenv(broker.PasswordVar(broker.AuditUser)), settings: settings}, nil
}

// RegisterFlags adds the flags of the database URLs, of the NATS server
// and of the services' settings.
func (c *verifyConfig) RegisterFlags(fs *flag.FlagSet) {
	c.schemas.RegisterFlags(fs)
	config.SecretVar(fs, &c.natsURL, "nats-url", "NATS server `URL` whose streams are audited (NATS_URL)")
	c.settings.RegisterFlags(fs)
}

// schemasExist returns ErrNoShop, naming the schemas that are missing, when
// a service's database or schema does not exist: nothing was migrated there
// (a wrong DATABASE_URL, or a database the demo never ran on).
func schemasExist(ctx context.Context, shop verify.Shop) error {
	var missing []string
	for _, e := range shop.Services {
		var ok bool
		err := shop.Pools[e.Name].QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL`, e.Schema).Scan(&ok)
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "3D000" { // invalid_catalog_name
			return fmt.Errorf("%w: %s (run `make demo` or `shop migrate` first, or set DATABASE_URL)", ErrNoShop, pgErr.Message)
		}
		if err != nil {
			return fmt.Errorf("verify: does schema %s exist: %w", e.Schema, err)
		}
		if !ok {
			missing = append(missing, e.Schema)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: the database has no schema %s (run `make demo` or `shop migrate` first, or set DATABASE_URL)",
			ErrNoShop, strings.Join(missing, ", "))
	}
	return nil
}

// streamsExist returns ErrNoShop when the NATS server holds none of the
// services' streams: a server of the machine that only answers on the
// address, not the shop's. One stream missing among others is the audit's
// to report (a stream lost or deleted).
func streamsExist(ctx context.Context, js jetstream.JetStream, reg registry.Registry, url string) error {
	var names []string
	for _, e := range reg {
		_, err := js.Stream(ctx, e.Stream)
		if err == nil {
			return nil
		}
		if !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("verify: stream %s on NATS at %s: %w", e.Stream, config.MaskURL(url), err)
		}
		names = append(names, e.Stream)
	}
	return fmt.Errorf("%w: NATS at %s has none of the shop's streams (%s); %s; "+
		"-streams=false checks the databases only", ErrNoShop, config.MaskURL(url), strings.Join(names, ", "), findTheDemo)
}
