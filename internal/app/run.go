package app

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/httpx"
)

// Run runs the named services in this process until ctx ends, over one NATS
// connection: `shop all` passes every name, `shop order` one. When
// cfg.NATSURL is empty it first starts an embedded NATS server with
// JetStream on 127.0.0.1:4222 (a free port if that is taken), storing
// under EmbeddedNATSDir. Running every service, it serves the dashboard on
// cfg.DashboardAddr too. Every listener is bound before anything starts, so
// an address that is taken stops the start-up at once. When one
// service fails, the others are stopped too and Run returns the error.
func Run(ctx context.Context, cfg Config, names []string, log *slog.Logger) error {
	return run(ctx, cfg, names, log, nil)
}

// RunDemo is Run of every service plus the demo: the payment service's
// fake provider is on (POST /payments/{id}/simulate, the curl it prints and
// the dashboard's Pay button), and once this process's own services listen
// and answer, it stocks the demo catalogue through its own inventory
// service (with cfg.OperatorToken, if one is set) and prints to out how to
// try the shop, with the addresses it really bound (the dashboard's may be
// a free port).
func RunDemo(ctx context.Context, cfg Config, log *slog.Logger, out io.Writer) error {
	cfg.FakeProvider = true
	return run(ctx, cfg, Names, log, func(ctx context.Context, urls map[string]string) {
		if err := seedDemo(ctx, urls, cfg.OperatorToken, out); err != nil && ctx.Err() == nil {
			log.Error("demo seed failed", "err", err)
		}
	})
}

// run is Run, calling ready (when not nil) once every service it runs
// answers /readyz, with the base URL each listens on by service name, and
// the dashboard's under "dashboard".
func run(ctx context.Context, cfg Config, names []string, log *slog.Logger,
	ready func(ctx context.Context, urls map[string]string)) error {
	url := cfg.NATSURL
	if url == "" {
		srv, err := startEmbeddedNATS(log)
		if err != nil {
			return err
		}
		// Deferred first, so it runs last: after every service has stopped.
		defer func() {
			srv.Shutdown()
			srv.WaitForShutdown()
		}()
		url = srv.ClientURL()
		log.Info("embedded nats started", "url", url, "store", EmbeddedNATSDir)
	}
	nc, err := connectNATS(url, log)
	if err != nil {
		return err
	}
	defer nc.Close()

	services := make([]*Service, 0, len(names))
	for _, name := range names {
		s, err := New(name, cfg, nc, log)
		if err != nil {
			return err
		}
		services = append(services, s)
	}
	stopTraces, err := exportTraces(ctx, cfg, services)
	if err != nil {
		return err
	}
	defer stopTraces() // after every service has stopped: flushes their last spans
	// Bound first, all of them: a taken address must stop the process
	// before it does anything (the demo would otherwise stock whatever
	// other process answers there).
	urls := make(map[string]string, len(services)+1)
	for _, s := range services {
		if err := s.listen(); err != nil {
			closeListeners(services)
			return err
		}
		urls[s.Name] = listenerURL(s.ln)
	}
	var dashboardLn net.Listener
	if runsAll(names) {
		if dashboardLn, err = listenDashboard(cfg, log); err != nil {
			closeListeners(services)
			return err
		}
		urls["dashboard"] = listenerURL(dashboardLn)
	}
	g, ctx := errgroup.WithContext(ctx)
	if runsAll(names) {
		// The reconciler reads every schema (see reconcile.go), so only
		// `shop all` runs it; its counts are served by the order service.
		job, closeJob, err := newReconcileJob(ctx, cfg, nc, log)
		if err != nil {
			return err
		}
		defer closeJob()
		for _, s := range services {
			if s.Name == "order" {
				s.collectors = append(s.collectors, newReconcileCollector(job))
			}
		}
		g.Go(func() error { return job.Run(ctx) })
	}
	for _, s := range services {
		g.Go(func() error { return s.Run(ctx) })
	}
	if dashboardLn != nil {
		g.Go(func() error { return runDashboard(ctx, dashboardLn, cfg, urls, log) })
	}
	if ready != nil {
		g.Go(func() error {
			for _, s := range services {
				if err := httpx.WaitReady(ctx, nil, urls[s.Name]); err != nil {
					return nil // stopping, or the service failed: Run says why
				}
			}
			ready(ctx, urls)
			return nil
		})
	}
	return g.Wait()
}

func closeListeners(services []*Service) {
	for _, s := range services {
		if s.ln != nil {
			s.ln.Close()
		}
	}
}

func startEmbeddedNATS(log *slog.Logger) (*server.Server, error) {
	// The demo's own services are the only clients, so when something (often
	// the machine's own NATS server) holds 4222, any free port will do.
	port := 4222
	ln, err := net.Listen("tcp", "127.0.0.1:4222")
	if err != nil {
		log.Warn("127.0.0.1:4222 is taken; the embedded nats listens on a free port instead "+
			"(set NATS_URL to use the server on 4222)", "err", err)
		port = -1
	} else {
		ln.Close()
	}
	return broker.Embedded("127.0.0.1", port, EmbeddedNATSDir)
}

// connectNATS connects to url and keeps reconnecting for as long as the
// process lives, including when the server is not up yet at start-up: a
// broker outage delays publishing but stops no service.
func connectNATS(url string, log *slog.Logger) (*nats.Conn, error) {
	masked := MaskURL(url)
	nc, err := nats.Connect(url,
		nats.Name("shop"),
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(time.Second),
		// A silent partition (packets dropped, no RST) is seen only by
		// unanswered pings: with the client's default of one ping every 2
		// minutes the connection would look fine for up to 6. Every 10s,
		// two unanswered: stale after about 30s, then reconnect, to another
		// node of a cluster if one answers.
		nats.PingInterval(10*time.Second),
		nats.MaxPingsOutstanding(2),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "url", masked, "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("nats connected", "url", MaskURL(nc.ConnectedUrl())) }),
	)
	if err != nil {
		return nil, fmt.Errorf("connect to nats %s: %w", masked, err)
	}
	return nc, nil
}
