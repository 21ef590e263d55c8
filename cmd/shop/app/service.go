// Package app is the plumbing every shop service shares: the start-up
// sequence (database, migrations, stream), the process lifecycle around
// each service's outbox relay, and the wiring of the parts that live in
// packages of their own (internal/config, internal/probe, internal/metrics,
// internal/tracing, internal/demo). It knows the services only from the
// registry cmd/shop gives it (the Registry of its config.Config).
//
// A process runs one service (`shop order`) or all four (`shop all`); either
// way each service is a Service whose Run returns when ctx ends, so one
// binary deploys as a single demo process or as many scaled ones.
package app

import (
	"cmp"
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
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/metrics"
	"github.com/shop-ref/shop/internal/probe"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/outbox"
)

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

	entry  registry.Entry       // what the service declares of itself
	cfg    config.Config        // the process's configuration, for the service's domain
	tracer trace.TracerProvider // the service's spans; nil: none
	access broker.Access        // what it does on NATS: its stream and the streams it reads
	ln     net.Listener         // bound by listen, before Run
	watch  *probe.JetStream     // whether JetStream answers, for /readyz and /metrics

	collectors []prometheus.Collector // extra metrics for its registry (the reconciler's, in `shop all`)

	// drift reports its own stream's configuration where it differs from
	// the shop's, unless kept: then the process runs the stream keeper,
	// which restores it and says so (streamkeeper.go).
	drift *streamKeeper
	kept  bool
}

// New returns the service called name, configured by cfg, publishing over nc.
func New(name string, cfg config.Config, nc *nats.Conn, log *slog.Logger) (*Service, error) {
	e, err := cfg.Registry.Get(name)
	if err != nil {
		return nil, err
	}
	access := e.Access()
	watch, err := probe.NewJetStream(nc, name, log.With("service", name))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	own := broker.StreamConfig(access.Stream, cfg.NATSReplicas, cfg.StreamLimits, access.Subjects...)
	return &Service{
		drift:       newStreamKeeper(nil, []jetstream.StreamConfig{own}, log.With("service", name)),
		watch:       watch,
		Name:        name,
		Schema:      e.Schema,
		entry:       e,
		Stream:      access.Stream,
		Subjects:    access.Subjects,
		access:      access,
		Addr:        cfg.Services[name].Addr,
		DatabaseURL: cfg.DatabaseURLOf(name),
		NATS:        nc,
		Logger:      log.With("service", name),
		cfg:         cfg,
		tracer:      cfg.Services[name].TracerProvider,
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
	// Postgres refusing connections (down, starting, "too many clients")
	// is waited out: the process starts when the database answers.
	if err := database.Retry(ctx, s.Logger, "migrate", func(ctx context.Context) error {
		return Migrate(ctx, s.DatabaseURL, s.entry, s.Logger)
	}); err != nil {
		if ctx.Err() != nil {
			return nil // stopped while waiting
		}
		return err
	}
	pool, err := database.NewPool(ctx, s.DatabaseURL, s.Schema, s.entry.PoolSize)
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
	srv, err := newHTTPServer(router, defaultHTTPLimits(), s.Logger)
	if err != nil {
		return err
	}

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
	g.Go(func() error { s.watch.Run(ctx); return nil })
	g.Go(func() error {
		// The relay and the consumers start once every stream of the
		// service is as the shop wants it (waitForStreams).
		if !s.waitForStreams(ctx, js) {
			return nil
		}
		// The rules hold for the configuration the shop gives the streams:
		// a process whose settings break them stops here. A stream that
		// differs on the server later is drift, which the stream keeper
		// restores and /readyz reports (keepStreams).
		configs, err := s.streamConfigs()
		if err != nil {
			return err
		}
		windows := make(map[string]time.Duration, len(configs))
		for name, c := range configs {
			windows[name] = c.Duplicates
		}
		if err := checkWindows(relayConfig().RetryHorizon(), windows, dom); err != nil {
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		if err := checkLimits(configs, dom); err != nil {
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		g.Go(func() error { s.keepStreams(ctx, js, streamCheckInterval(s.cfg)); return nil })
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

// relayConfig is the configuration of every service's outbox relay, in one
// place: start-up checks its RetryHorizon against the streams' duplicate
// windows and the inboxes' retention (checkWindows).
func relayConfig() outbox.Config {
	return outbox.Config{Retention: OutboxRetention, Hooks: outbox.Hooks{FailpointFunc: failpoint.Inject}}
}

// assemble builds the service's parts over pool and js, wired to one
// metrics registry: the outbox relay, the domain and the HTTP router
// (/healthz, /readyz, /metrics and the domain's routes). It does no I/O.
func (s *Service) assemble(pool *pgxpool.Pool, js jetstream.JetStream) (*outbox.Relay, registry.Domain, http.Handler, error) {
	m := metrics.New(s.Name, s.Logger)
	// Name is left to the relay's default (host, pid, random), which keeps
	// several copies of one service apart in claimed_by.
	rc := relayConfig()
	// The mode is the service's own (<NAME>_RELAY_MODE, RELAY_MODE): the
	// rest of relayConfig is the same in both, so start-up's window checks
	// hold for either.
	rc.Mode = s.cfg.Services[s.Name].RelayMode
	rc.SlotDropHint = cli.DropSlotCommand(s.Name)
	rc.Logger, rc.Hooks.ObservePublishFunc, rc.TracerProvider = s.Logger, m.ObservePublish, s.tracer
	relay, err := outbox.NewRelay(pool, js, rc)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%s: %w", s.Name, err)
	}
	build := s.cfg.Constructor(s.Name)
	if build == nil { // a config.Config not made by config.LoadFor
		return nil, nil, nil, fmt.Errorf("%s: no constructor: load the configuration with config.LoadFor", s.Name)
	}
	dom, err := build(registry.Deps{
		Pool:           pool,
		JetStream:      js,
		Logger:         s.Logger,
		TracerProvider: s.tracer,
		Readers:        s.cfg.Registry.Readers(),
		Hooks:          registry.Hooks{FailpointFunc: failpoint.Inject, ObserveInboxFunc: m.ObserveProcess},
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%s: %w", s.Name, err)
	}
	if err := checkConsumers(s.entry, dom); err != nil {
		return nil, nil, nil, err
	}
	m.Watch(pool, relay, dom, s.NATS, s.watch)
	m.MustRegister(s.collectors...)
	if !s.kept { // else the keeper's metrics say it, served by one service
		m.MustRegister(s.drift.collectors()...)
	}
	router := probe.NewRouter(pool, s.NATS, s.watch, &probe.Relay{Var: strings.ToUpper(s.Name) + "_RELAY_MODE", State: relay.State, DB: pool,
		DropSlot: cli.DropSlotCommand(s.Name)}, httpx.Trace(s.tracer), m.Instrument)
	router.Method(http.MethodGet, "/metrics", m.Handler())
	dom.Routes(router)
	m.InitRoutes(router)
	return relay, dom, router, nil
}

// waitForStreams waits until each stream of the service — its own and
// those it reads — exists with the shop's configuration, checking again
// with a growing pause (up to 5 s): the stream keeper creates a missing
// stream and restores one that drifted (streamkeeper.go); no service may
// create or change a stream (broker.Permissions). Until then the service
// serves HTTP and commits events to its outbox, which is what the outbox
// is for, but publishes and consumes nothing: an event published into a
// stream in memory, or one that keeps a single message, would be lost; a
// stream that republishes or mirrors brings in events no service
// published. /readyz says which stream is wrong and how (checkStreams). It
// logs once when it starts waiting, not once per try, and returns true once
// every stream is right, false when ctx ends first.
func (s *Service) waitForStreams(ctx context.Context, js jetstream.JetStream) bool {
	wait := 250 * time.Millisecond
	waiting := false
	for {
		problems := s.checkStreams(ctx, js)
		switch {
		case len(problems) == 0:
			s.Logger.Info("streams ready", "own", s.Stream)
			return true
		case ctx.Err() != nil:
			return false // stopping before the streams were right is no failure
		case !waiting:
			waiting = true
			s.Logger.Warn("waiting for the stream keeper: publishing and consuming start once every stream of the service "+
				"exists with the shop's configuration", "problems", problems)
		default:
			s.Logger.Debug("streams still not right", "problems", problems)
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// checkStreams looks each stream of the service up once, each call bounded
// so that a hung request (a partition) cannot stall the checks, records
// what is wrong with each for /readyz, reports the drift of its own stream
// (observe), and returns the problems, "STREAM: what", none when every
// stream is right. A request that fails (JetStream unreachable, no quorum)
// is a problem too, not recorded: the "jetstream" line of /readyz says it.
func (s *Service) checkStreams(ctx context.Context, js jetstream.JetStream) []string {
	configs, err := s.streamConfigs()
	if err != nil {
		return []string{err.Error()}
	}
	var problems []string
	for _, name := range s.streams() {
		callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		st, err := js.Stream(callCtx, name)
		cancel()
		var state probe.StreamState
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound):
			state.Problem = "missing: the stream keeper creates it (a process of the shop with " +
				broker.PasswordVar(broker.StreamsUser) + ")"
		case err != nil:
			problems = append(problems, name+": "+err.Error())
			continue
		default:
			have := st.CachedInfo().Config
			s.observe(configs[name], have)
			if drift := broker.Drift(have, configs[name]); len(drift) > 0 {
				state = probe.StreamState{Blocks: true, Problem: "configuration differs from the shop's (" +
					strings.Join(driftStrings(drift), "; ") + "): the stream keeper restores it, or, where no update can, " +
					"an operator recreates it (docs/operating.md, \"A stream the keeper cannot restore\")"}
			}
		}
		if s.watch != nil { // nil: a Service not made by New
			s.watch.SetStream(name, state)
		}
		if state.Problem != "" {
			problems = append(problems, name+": "+state.Problem)
		}
	}
	return problems
}

// streams are the names of the service's streams, its own first.
func (s *Service) streams() []string { return append([]string{s.Stream}, s.access.Reads()...) }

// streamConfigs is the shop's configuration of each stream of the service,
// by name (broker.StreamConfig, with the subjects of the stream's owner).
func (s *Service) streamConfigs() (map[string]jetstream.StreamConfig, error) {
	configs := make(map[string]jetstream.StreamConfig, 1+len(s.access.Reads()))
	configs[s.Stream] = broker.StreamConfig(s.Stream, s.cfg.NATSReplicas, s.cfg.StreamLimits, s.Subjects...)
	for _, name := range s.access.Reads() {
		owner, ok := s.cfg.Registry.Owner(name)
		if !ok { // Validate refuses a consumer of a stream no service owns
			return nil, fmt.Errorf("no service publishes to stream %s", name)
		}
		configs[name] = broker.StreamConfig(name, s.cfg.NATSReplicas, s.cfg.StreamLimits, owner.Access().Subjects...)
	}
	return configs, nil
}

// observe reports the drift of the service's own stream, have as the
// server has it, unless the process keeps the streams: then the keeper
// restores it and reports (the streams a service reads are their owners'
// to report, so that a drift is logged once per process).
func (s *Service) observe(want, have jetstream.StreamConfig) {
	if want.Name == s.Stream && !s.kept && s.drift != nil { // nil: a Service not made by New
		s.drift.observe(want, have)
	}
}

// keepStreams checks the service's streams again every every, for /readyz
// and the drift report (checkStreams): a stream deleted, or changed, while
// the service runs. The relay and the consumers go on meanwhile (what a
// stream loses, the reconciler's stream audit resends from the outbox once
// the keeper has made it right); /readyz says what is wrong.
func (s *Service) keepStreams(ctx context.Context, js jetstream.JetStream, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.checkStreams(ctx, js)
	}
}

// streamCheckEvery is how often each service looks its streams up, and the
// stream keeper creates the missing ones and restores drift
// (streamkeeper.go).
const streamCheckEvery = 10 * time.Second

// streamCheckInterval is how often streams are checked: streamCheckEvery,
// unless a test says otherwise (cfg.Test.StreamCheck).
func streamCheckInterval(cfg config.Config) time.Duration {
	return cmp.Or(cfg.Test.StreamCheck, streamCheckEvery)
}

// checkLimits enforces what the streams' limits must keep: a stream is the
// only copy of an event once the outbox has deleted its row, the stream
// audit looks for every event published within the outbox's retention, and
// a consumer may be replayed its stream's last ReplayWindow; a message
// dropped earlier would be a false loss, or a replay that finds nothing.
func checkLimits(configs map[string]jetstream.StreamConfig, dom registry.Domain) error {
	for name, c := range configs {
		if c.MaxAge > 0 && c.MaxAge < OutboxRetention {
			return fmt.Errorf("stream %s keeps messages %s (max age), less than the outbox retention %s: "+
				"raise NATS_STREAM_MAX_AGE", name, c.MaxAge, OutboxRetention)
		}
	}
	for _, c := range dom.Consumers() {
		if age := configs[c.Stream()].MaxAge; age > 0 && age < registry.ReplayWindow {
			return fmt.Errorf("stream %s keeps messages %s (max age), less than the replay window %s of consumer %s: "+
				"raise NATS_STREAM_MAX_AGE", c.Stream(), age, registry.ReplayWindow, c.Name())
		}
	}
	return nil
}

// checkWindows enforces the windows rule against the relay that really runs
// and the streams as the shop configures them: the relay's retry horizon is shorter
// than every stream's duplicate window (so the stream drops the copies of
// ordinary retries), which is shorter than every inbox's retention (so a
// copy that gets past the window still meets its processed_events row).
func checkWindows(retryHorizon time.Duration, duplicates map[string]time.Duration, dom registry.Domain) error {
	for name, d := range duplicates {
		if retryHorizon >= d {
			return fmt.Errorf("the outbox relay's retry horizon (%s) must be shorter than the duplicate window (%s) of stream %s",
				retryHorizon, d, name)
		}
	}
	for _, c := range dom.Consumers() {
		if w := duplicates[c.Stream()]; w >= registry.InboxRetention {
			return fmt.Errorf("the duplicate window (%s) of stream %s must be shorter than the inbox retention (%s) of consumer %s, "+
				"and the outbox relay's retry horizon (%s) shorter than both", w, c.Stream(), registry.InboxRetention, c.Name(), retryHorizon)
		}
	}
	return nil
}

// Migrate creates the database at databaseURL when it is missing and applies
// the migrations of e's schema: the eventing tables, its libraries' and its
// own. It is idempotent and safe to run from several processes at once.
func Migrate(ctx context.Context, databaseURL string, e registry.Entry, log *slog.Logger) error {
	if err := database.EnsureExists(ctx, databaseURL); err != nil {
		return fmt.Errorf("%s: %w", e.Name, err)
	}
	if err := migrations.Apply(ctx, databaseURL, e.Schema, e.Sets(), log); err != nil {
		return fmt.Errorf("%s: %w", e.Name, err)
	}
	log.Info("schema migrated", "schema", e.Schema)
	return nil
}
