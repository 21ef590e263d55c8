package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/demo"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/registry"
)

// serveAll returns `shop all [-demo]`: every service of reg in one process,
// with an embedded NATS server unless NATS_URL names one.
func serveAll(reg registry.Registry) command {
	return func(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
		var withDemo bool
		cfg, log, err := startUp(reg, "all", args, getenv, stderr, func(fs *flag.FlagSet) {
			fs.BoolVar(&withDemo, "demo", false, "stock a small catalogue and print curl commands to try")
		})
		if err != nil {
			return err
		}
		if withDemo {
			// Before the configuration is logged, so the log shows what runs.
			if err := demo.Settings(cfg.Settings); err != nil {
				return err
			}
			cfg.DashboardDemo = true
		}
		log.Info("starting", "services", cfg.Registry.Names(), "config", cfg)
		if withDemo {
			return app.RunDemo(ctx, cfg, log, stdout)
		}
		return app.Run(ctx, cfg, cfg.Registry.Names(), log)
	}
}

// serveDashboard returns `shop dashboard`: the live dashboard alone, against
// the schemas and public URLs of reg's services (app.RunDashboard); Compose
// runs it as a service of its own.
func serveDashboard(reg registry.Registry) command {
	return func(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
		cfg, log, err := startUp(reg, "dashboard", args, getenv, stderr, nil)
		if err != nil {
			return err
		}
		log.Info("starting", "services", []string{"dashboard"}, "config", cfg)
		return app.RunDashboard(ctx, cfg, log)
	}
}

// serveOne returns `shop <service>`: one service of reg (HTTP, its
// consumers, its relay) against the NATS server of NATS_URL, its default
// when unset.
func serveOne(reg registry.Registry, service string) command {
	return func(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
		cfg, log, err := startUp(reg, service, args, getenv, stderr, nil)
		if err != nil {
			return err
		}
		if cfg.NATSURL == "" { // only `shop all` embeds a server
			cfg.NATSURL = config.DefaultNATSURL
		}
		log.Info("starting", "services", []string{service}, "config", cfg)
		return app.Run(ctx, cfg, []string{service}, log)
	}
}

// startUp is what every service command does before it runs: read the
// configuration of reg's services from the environment and the flags (the
// command adds its own with more, which may be nil), arm the failpoints of
// SHOP_FAILPOINTS, and make the logger.
func startUp(reg registry.Registry, target string, args []string, getenv func(string) string, stderr io.Writer, more func(*flag.FlagSet)) (config.Config, *slog.Logger, error) {
	cfg, err := config.LoadFor(reg, getenv)
	if err != nil {
		return config.Config{}, nil, err
	}
	fs := cli.ConfigFlags("shop "+target, "", "", &cfg, stderr)
	if more != nil {
		more(fs)
	}
	if err := cli.Parse(fs, args); err != nil {
		return config.Config{}, nil, err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	// The failpoints are armed once, here, from SHOP_FAILPOINTS; a name
	// that no failpoint has stops the start-up.
	if err := failpoint.Init(getenv); err != nil {
		return config.Config{}, nil, err
	}
	if spec := failpoint.Spec(); spec != "" {
		log.Warn("failpoints armed: this process will fail or crash on purpose", "SHOP_FAILPOINTS", spec)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "shop %s: unexpected arguments %q\n", target, fs.Args())
		return config.Config{}, nil, cli.ErrUsage
	}
	return cfg, log, nil
}
