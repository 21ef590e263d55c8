package app

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/broker"
)

// Run runs the named services in this process until ctx ends, over one NATS
// connection: `shop all` passes every name, `shop order` one. When
// cfg.NATSURL is empty it first starts an embedded NATS server with
// JetStream on 127.0.0.1:4222 (a free port if that is taken), storing
// under EmbeddedNATSDir. Running every service, it serves the dashboard on
// cfg.DashboardAddr too. When one
// service fails, the others are stopped too and Run returns the error.
func Run(ctx context.Context, cfg Config, names []string, log *slog.Logger) error {
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
	g, ctx := errgroup.WithContext(ctx)
	if runsAll(names) {
		// The reconciler reads every schema (see reconcile.go), so only
		// `shop all` runs it; its counts are served by the order service.
		job, closeJob, err := newReconcileJob(ctx, cfg, log)
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
	if runsAll(names) {
		g.Go(func() error { return runDashboard(ctx, cfg, log) })
	}
	return g.Wait()
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
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "url", masked, "err", err)
			}
		}),
		nats.ReconnectHandler(func(*nats.Conn) { log.Info("nats connected", "url", masked) }),
	)
	if err != nil {
		return nil, fmt.Errorf("connect to nats %s: %w", masked, err)
	}
	return nc, nil
}
