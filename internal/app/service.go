// Package app is the plumbing every shop service shares: configuration, the
// start-up sequence (database, migrations, stream), the health endpoints and
// the process lifecycle around each service's outbox relay.
//
// A process runs one service (`shop order`) or all four (`shop all`); either
// way each service is a Service whose Run returns when ctx ends, so one
// binary deploys as a single demo process or as many scaled ones.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Names lists the services in start-up order.
var Names = migrations.Services

// OutboxRetention is how long published events stay in a service's outbox
// (for audits, replays and `shop verify`) before the relay deletes them.
const OutboxRetention = 72 * time.Hour

// ShutdownTimeout bounds how long a stopping service waits for HTTP requests
// in flight.
const ShutdownTimeout = 10 * time.Second

// Service is one shop service as a process runs it.
type Service struct {
	Name     string   // "order"
	Schema   string   // the schema it owns: "orders"
	Stream   string   // the JetStream stream it publishes to: "ORDERS"
	Subjects []string // the stream's subjects: "orders.>"

	Addr        string // HTTP listen address
	DatabaseURL string
	NATS        *nats.Conn
	Logger      *slog.Logger

	cfg Config       // the process's configuration, for the service's domain
	ln  net.Listener // bound by listen, before Run

	collectors []prometheus.Collector // extra metrics for its registry (the reconciler's, in `shop all`)
}

// New returns the service called name, configured by cfg, publishing over nc.
func New(name string, cfg Config, nc *nats.Conn, log *slog.Logger) (*Service, error) {
	schema, ok := migrations.Schemas[name]
	if !ok {
		return nil, fmt.Errorf("unknown service %q (want one of %s)", name, strings.Join(Names, ", "))
	}
	return &Service{
		Name: name,
		// The contract names each stream after the producing schema, in
		// capitals, and its subjects <schema>.<aggregate_id>.<EventType>.
		Schema:      schema,
		Stream:      strings.ToUpper(schema),
		Subjects:    []string{schema + ".>"},
		Addr:        cfg.Services[name].Addr,
		DatabaseURL: cfg.DatabaseURLOf(name),
		NATS:        nc,
		Logger:      log.With("service", name),
		cfg:         cfg,
	}, nil
}

// Run brings the service up and serves until ctx ends: it creates the
// database if needed, migrates the service's schema, serves HTTP and runs
// the outbox relay. When ctx ends it stops taking requests, lets those in
// flight finish (up to ShutdownTimeout) and waits for the relay to return.
func (s *Service) Run(ctx context.Context) error {
	if s.ln == nil {
		if err := s.listen(); err != nil {
			return err
		}
	}
	defer s.ln.Close() // when it returns before serving; closing twice is harmless
	if err := Migrate(ctx, s.DatabaseURL, s.Name, s.Logger); err != nil {
		return err
	}
	pool, err := database.NewPool(ctx, s.DatabaseURL, s.Schema, poolSize(s.Name))
	if err != nil {
		return err
	}
	defer pool.Close()
	js, err := jetstream.New(s.NATS)
	if err != nil {
		return fmt.Errorf("%s: jetstream: %w", s.Name, err)
	}
	relay, dom, router, err := s.assemble(pool, js)
	if err != nil {
		return err
	}
	ln := s.ln
	srv := &http.Server{Handler: httpx.Bodies(router), ReadHeaderTimeout: 5 * time.Second}

	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		s.Logger.Info("http listening", "addr", ln.Addr().String())
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("%s: serve http: %w", s.Name, err)
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
		defer cancel()
		if err := srv.Shutdown(shutdownCtx); err != nil {
			return fmt.Errorf("%s: shut down http: %w", s.Name, err)
		}
		return nil
	})
	g.Go(func() error {
		// To the relay, a subject that no stream captures is a deterministic
		// error that makes the event dead, and a consumer cannot start on a
		// missing stream; so both start once the streams exist.
		if err := s.ensureStreams(ctx, js); err != nil || ctx.Err() != nil {
			return err
		}
		g.Go(func() error {
			if err := dom.Run(ctx); err != nil && ctx.Err() == nil {
				return fmt.Errorf("%s: %w", s.Name, err)
			}
			return nil
		})
		if err := relay.Run(ctx); err != nil && ctx.Err() == nil {
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		return nil
	})
	err = g.Wait()
	s.Logger.Info("service stopped")
	return err
}

// listen binds the service's HTTP address. Connections wait in the
// listener's backlog until Run serves them.
func (s *Service) listen() error {
	ln, err := net.Listen("tcp", s.Addr)
	if err != nil {
		return fmt.Errorf("%s: listen on %s: %w", s.Name, s.Addr, err)
	}
	s.ln = ln
	return nil
}

// assemble builds the service's parts over pool and js, wired to one
// metrics registry: the outbox relay, the domain and the HTTP router
// (/healthz, /readyz, /metrics and the domain's routes). It does no I/O.
func (s *Service) assemble(pool *pgxpool.Pool, js jetstream.JetStream) (*outbox.Relay, domain, http.Handler, error) {
	m := newMetrics(s.Name, s.Logger)
	// Name is left to the relay's default (host, pid, random), which keeps
	// several copies of one service apart in claimed_by.
	relay, err := outbox.NewRelay(pool, js, outbox.Config{
		Retention: OutboxRetention, Logger: s.Logger, ObservePublishFunc: m.observePublish,
		FailpointFunc: failpoint.Inject,
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%s: %w", s.Name, err)
	}
	dom, err := newDomain(s.Name, pool, js, s.cfg, s.Logger, m.observeProcess)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%s: %w", s.Name, err)
	}
	m.watch(pool, relay, dom)
	m.r.MustRegister(s.collectors...)
	router := newRouter(pool, s.NATS, m.instrument)
	router.Method(http.MethodGet, "/metrics", m.handler())
	dom.Routes(router)
	m.initRoutes(router)
	return relay, dom, router, nil
}

// ensureStreams creates or updates every producer's stream, waiting for
// NATS while it is unreachable: the service serves HTTP and commits events to
// its outbox meanwhile, which is what the outbox is for. It returns nil once
// the streams exist or ctx has ended, and an error at once when JetStream
// refuses the configuration.
func (s *Service) ensureStreams(ctx context.Context, js jetstream.JetStream) error {
	wait := 500 * time.Millisecond
	for {
		attemptCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		var err error
		for name, subjects := range streams {
			if _, err = broker.EnsureStream(attemptCtx, js, name, s.cfg.NATSReplicas, subjects...); err != nil {
				break
			}
		}
		cancel()
		var apiErr *jetstream.APIError
		switch {
		case err == nil:
			s.Logger.Info("streams ensured", "own", s.Stream)
			return nil
		case ctx.Err() != nil:
			return nil // stopping before NATS came back is no failure
		case errors.As(err, &apiErr):
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		s.Logger.Warn("stream not ensured yet; retrying", "stream", s.Stream, "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
	}
}

// Migrate creates the database at databaseURL when it is missing and applies
// the migrations of service's schema. It is idempotent and safe to run from
// several processes at once.
func Migrate(ctx context.Context, databaseURL, service string, log *slog.Logger) error {
	schema, ok := migrations.Schemas[service]
	if !ok {
		return fmt.Errorf("unknown service %q (want one of %s)", service, strings.Join(Names, ", "))
	}
	if err := database.EnsureExists(ctx, databaseURL); err != nil {
		return fmt.Errorf("%s: %w", service, err)
	}
	if err := migrations.Apply(ctx, databaseURL, service, schema, log); err != nil {
		return fmt.Errorf("%s: %w", service, err)
	}
	log.Info("schema migrated", "schema", schema)
	return nil
}
