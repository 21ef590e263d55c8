package operator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/reconcile"
	"github.com/shop-ref/shop/internal/verify"
)

// ErrViolations is what Verify returns when an invariant does not hold,
// after printing its report: shop exits 1 and prints nothing more.
var ErrViolations = errors.New("invariants violated")

// Verify is `shop verify [-wait D] [-repair] [-streams=false]`: it checks
// the contract's invariants and prints the report. With -repair it first
// runs the reconciler once (internal/reconcile) and prints its findings;
// the result still tells only whether the invariants hold. With -streams
// (the default) it audits each service's stream against its outbox on the
// NATS server of the configuration (its default when unset, as a single
// service does); a server it cannot reach is a failed check in the report,
// not a pass.
func (s Shop) Verify(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cfg, err := app.LoadConfigFor(s.Services, getenv)
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
	fs.BoolVar(&streams, "streams", true, "also audit every service's stream on the NATS server (NATS_URL; else a demo's embedded server running here; else "+app.DefaultNATSURL+") against its outbox; false checks the databases only and says so")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}

	vp, closePools, err := app.OpenShop(ctx, cfg, 2)
	if err != nil {
		return err
	}
	defer closePools()
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
		return ErrViolations
	}
	return nil
}
