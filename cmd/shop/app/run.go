package app

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/demo"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Run runs the named services in this process until ctx ends, each over its
// own NATS connection as its own user: `shop all` passes every name, `shop
// order` one. When cfg.NATSURL is empty it first starts an embedded NATS
// server with JetStream on 127.0.0.1:4222 (a free port if that is taken),
// storing under config.EmbeddedNATSDir, whose users (broker.Users) get random
// passwords. Where it knows the stream keeper's password (the embedded
// server's, or STREAMS_NATS_PASSWORD) it keeps the shop's streams
// (streamkeeper.go). Running every service, it serves the dashboard on
// cfg.DashboardAddr too. Every listener is bound before anything starts, so
// an address that is taken stops the start-up at once. When one service
// fails, the others are stopped too and Run returns the error.
func Run(ctx context.Context, cfg config.Config, names []string, log *slog.Logger) error {
	return run(ctx, cfg, names, log, nil)
}

// RunDemo is Run of every service plus the demo: the payment service's
// fake provider is on (POST /payments/{id}/simulate, the curl it prints and
// the dashboard's Pay button), the dashboard may place and pay orders
// (config.Config.DashboardDemo), and once this process's own services listen
// and answer, it stocks the demo catalogue through its own inventory
// service (with cfg.OperatorToken, if one is set) and prints to out how to
// try the shop, with the addresses it really bound (the dashboard's may be
// a free port).
func RunDemo(ctx context.Context, cfg config.Config, log *slog.Logger, out io.Writer) error {
	if err := demo.Settings(cfg.Settings); err != nil {
		return err
	}
	cfg.DashboardDemo = true // the page's buttons
	return run(ctx, cfg, cfg.Registry.Names(), log, func(ctx context.Context, urls map[string]string, js jetstream.JetStream) {
		settled := func(ctx context.Context) error { return shopSettled(ctx, cfg, js) }
		if err := demo.Seed(ctx, urls, config.Setting[string](cfg.Settings, "OPERATOR_TOKEN"), settled, out); err != nil && ctx.Err() == nil {
			log.Error("demo seed failed", "err", err)
		}
	})
}

// run is Run, calling ready (when not nil) once every service it runs
// answers /readyz, with the base URL each listens on by service name, and
// the dashboard's under "dashboard", and JetStream as the audit user (who
// may read every consumer's state; nil when the process has no audit
// connection).
func run(ctx context.Context, cfg config.Config, names []string, log *slog.Logger,
	ready func(ctx context.Context, urls map[string]string, js jetstream.JetStream)) error {
	url, auth := cfg.NATSURL, natsAuth(cfg)
	if url == "" {
		passwords := newPasswords(cfg)
		srv, err := startEmbeddedNATS(cfg, passwords, log)
		if err != nil {
			return err
		}
		// Deferred first, so it runs last: after every service has stopped.
		defer func() {
			srv.Shutdown()
			srv.WaitForShutdown()
		}()
		url, auth = srv.ClientURL(), passwords
		log.Info("embedded nats started", "url", url, "store", config.EmbeddedNATSDir)
		if err := writeDemoNATS(url, passwords[broker.AuditUser]); err != nil {
			log.Warn("could not leave the embedded server's address and audit password for shop verify", "err", err)
		}
		// A stopped demo's server is gone: verify must not be sent there.
		defer os.Remove(DemoNATSURLFile)
	} else if missing := anonymous(auth, names); len(missing) > 0 {
		log.Warn("no NATS password for some services: they connect anonymously, and anyone who reaches NATS may publish "+
			"into any stream or delete one; set <SERVICE>_NATS_PASSWORD for a server with the shop's users (deploy/nats/auth.conf)",
			"services", missing)
	}
	// One connection per service, as its own NATS user: what one service
	// may do on NATS is only what it needs (broker.Permissions).
	conns := make(map[string]*nats.Conn, len(names))
	defer func() {
		for _, nc := range conns {
			nc.Close()
		}
	}()
	users := slices.Clone(names)
	reconciles := slices.Contains(names, "order") // the reconciler runs beside the saga (reconcile.go)
	// The reconciler's stream audit reads as the audit user: in `shop
	// all`, and wherever its password is given.
	audits := reconciles && (runsAll(cfg, names) || cfg.AuditNATSPassword != "")
	if audits {
		users = append(users, broker.AuditUser)
	}
	// The stream keeper, wherever its user's password is known: the
	// embedded server's, or STREAMS_NATS_PASSWORD (streamkeeper.go). And
	// where every service of the process connects anonymously (a server
	// without users, where anyone may create a stream): else no one would
	// create the streams, which no service does.
	keeps := auth[broker.StreamsUser] != "" || len(anonymous(auth, names)) == len(names)
	if keeps {
		users = append(users, broker.StreamsUser)
	}
	for _, name := range users {
		nc, err := connectNATS(url, name, auth[name], log)
		if err != nil {
			return err
		}
		conns[name] = nc
	}

	services := make([]*Service, 0, len(names))
	for _, name := range names {
		s, err := New(name, cfg, conns[name], log)
		if err != nil {
			return err
		}
		s.kept = keeps
		services = append(services, s)
	}
	var keeper *streamKeeper
	if keeps {
		js, err := jetstream.New(conns[broker.StreamsUser])
		if err != nil {
			return fmt.Errorf("stream keeper: %w", err)
		}
		keeper = newStreamKeeper(js, shopStreams(cfg), log.With("service", "streams"))
		// Its counts are served by one service: the order service, where
		// compose gives the password, else the first.
		for i, s := range services {
			if s.Name == "order" || (i == 0 && !slices.Contains(names, "order")) {
				s.collectors = append(s.collectors, keeper.collectors()...)
			}
		}
	} else {
		log.Info("no stream keeper in this process: its services wait for another process of the shop to create their streams, " +
			"and a stream whose configuration drifted is reported, not restored; set " +
			broker.PasswordVar(broker.StreamsUser) + " for this process to create and restore them")
	}
	stopTraces, err := exportTraces(ctx, cfg, services, log)
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
	if runsAll(cfg, names) {
		var err error
		if dashboardLn, err = listenDashboard(cfg, log); err != nil {
			closeListeners(services)
			return err
		}
		urls["dashboard"] = listenerURL(dashboardLn)
	}
	g, ctx := errgroup.WithContext(ctx)
	if reconciles {
		// Wherever the saga runs, one copy at a time (reconcile.go); its
		// counts are served by the order service.
		if !audits {
			log.Info("the reconciler runs without its stream audit: set AUDIT_NATS_PASSWORD for it to read the streams")
		}
		job, closeJob, err := newReconcileJob(ctx, cfg, conns[broker.AuditUser], log)
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
	if keeper != nil {
		g.Go(func() error { keeper.run(ctx, streamCheckInterval(cfg)); return nil })
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
			var js jetstream.JetStream
			if nc := conns[broker.AuditUser]; nc != nil {
				js, _ = jetstream.New(nc) // only fails on a nil connection
			}
			ready(ctx, urls, js)
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

// natsAuth is the NATS password of each user cfg gives one, by user name.
func natsAuth(cfg config.Config) map[string]string {
	auth := map[string]string{broker.AuditUser: cfg.AuditNATSPassword, broker.StreamsUser: cfg.StreamsNATSPassword}
	for name, sc := range cfg.Services {
		auth[name] = sc.NATSPassword
	}
	return auth
}

// anonymous lists the services of names without a password in auth.
func anonymous(auth map[string]string, names []string) []string {
	var missing []string
	for _, name := range names {
		if auth[name] == "" {
			missing = append(missing, name)
		}
	}
	return missing
}

// newPasswords makes a random password for every NATS user of the shop, for
// the embedded server of one `shop all`: nothing outside the process knows
// them (but the audit user's, see writeDemoNATS), and the process runs the
// stream keeper with its own.
func newPasswords(cfg config.Config) map[string]string {
	passwords := map[string]string{broker.AuditUser: rand.Text(), broker.StreamsUser: rand.Text()}
	for _, name := range cfg.Registry.Names() {
		passwords[name] = rand.Text()
	}
	return passwords
}

// DemoAuditPasswordFile is where `shop all` leaves the password of its
// embedded server's audit user (read-only), and DemoNATSURLFile the
// server's address while it runs (4222 is often another server's: this
// machine kind's own NATS, say), so that `shop verify` and `shop outbox`
// run beside the demo read its streams. Rewritten at every start,
// readable by the owner only.
var (
	DemoAuditPasswordFile = filepath.Join(config.EmbeddedNATSDir, "audit.password")
	DemoNATSURLFile       = filepath.Join(config.EmbeddedNATSDir, "url")
)

func writeDemoNATS(url, auditPassword string) error {
	if err := os.MkdirAll(filepath.Dir(DemoAuditPasswordFile), 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(DemoAuditPasswordFile, []byte(auditPassword+"\n"), 0o600); err != nil {
		return err
	}
	return os.WriteFile(DemoNATSURLFile, []byte(url+"\n"), 0o600)
}

// OperatorNATSURL is where the operator commands (verify, outbox republish)
// find NATS: natsURL (NATS_URL); else the embedded server of a demo
// running here; else config.DefaultNATSURL.
func OperatorNATSURL(natsURL string) string {
	if natsURL != "" {
		return natsURL
	}
	if b, err := os.ReadFile(DemoNATSURLFile); err == nil {
		if u := strings.TrimSpace(string(b)); u != "" {
			return u
		}
	}
	return config.DefaultNATSURL
}

// AuditConnectOptions are the options to connect to NATS as the audit
// user (broker.UserOptions): with password (AUDIT_NATS_PASSWORD); else with
// the password a local demo left in DemoAuditPasswordFile (its server may
// be on 4222 or, when that was taken, on the port it logged); else
// anonymous, as an unsecured server allows.
func AuditConnectOptions(password string) []nats.Option {
	p := password
	if p == "" { // the demo's, if one ran here: wrong for any other secured server, ignored by an open one
		if b, err := os.ReadFile(DemoAuditPasswordFile); err == nil {
			p = strings.TrimSpace(string(b))
		}
	}
	return broker.UserOptions(broker.AuditUser, p)
}

func startEmbeddedNATS(cfg config.Config, passwords map[string]string, log *slog.Logger) (*server.Server, error) {
	users, err := broker.Users(cfg.Registry.Access(), passwords)
	if err != nil {
		return nil, err
	}
	// The demo's own services are the only clients, so when something (often
	// the machine's own NATS server) holds 4222, any free port will do.
	port := 4222
	ln, err := net.Listen("tcp", "127.0.0.1:4222")
	if err != nil {
		log.Warn("127.0.0.1:4222 is taken; the embedded nats listens on a free port instead "+
			"(set NATS_URL to use the server on 4222; shop verify run in this directory finds this one through "+DemoNATSURLFile+")", "err", err)
		port = -1
	} else {
		ln.Close()
	}
	return broker.Embedded("127.0.0.1", port, config.EmbeddedNATSDir, broker.WithUsers(users))
}

// The client's stale-connection detection: a connection whose server
// answered none of MaxPingsOut pings sent PingInterval apart is replaced,
// so a silent partition is noticed within about
// (MaxPingsOut+1)·PingInterval.
const (
	PingInterval = time.Second
	MaxPingsOut  = 3
)

// connectNATS connects to url as user (with password; none: anonymously)
// and keeps reconnecting for as long as the process lives, including when
// the server is not up yet at start-up: a broker outage delays publishing
// but stops no service. A permissions violation — the server refusing
// something this user may not do — is logged at ERROR and ends nothing; so
// is a server refusing the credentials themselves, which the service's
// watch reports and /readyz answers not ready for (jetstream.go).
func connectNATS(url, user, password string, log *slog.Logger) (*nats.Conn, error) {
	masked := config.MaskURL(url)
	log = log.With("nats_user", user)
	opts := []nats.Option{
		nats.Name("shop " + user),
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(time.Second),
		// A silent partition (packets dropped, no RST) is seen only by
		// unanswered pings: with the client's default of one ping every 2
		// minutes the connection would look fine for up to 6, and with one
		// every 10 s (two unanswered) the shop stalled about 30 s. Every
		// second, three unanswered: stale within about 4 s, then reconnect,
		// to another node of a cluster if one answers. Three, not one, so
		// that a busy machine's late PONG is not a reconnect. The cost is
		// a PING and a PONG (6 bytes each, about 130 bytes a second on the
		// wire with TCP/IP headers) per connection, 5 connections for
		// `shop all`: nothing beside the traffic of one order.
		nats.PingInterval(PingInterval),
		nats.MaxPingsOutstanding(MaxPingsOut),
		// A server that refuses the credentials twice would otherwise make
		// the client close the connection for good: the service would run
		// deaf until restarted, even after the server is mended. It keeps
		// trying; the service's watch reports the refusal (jetstream.go).
		nats.IgnoreAuthErrorAbort(),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "url", masked, "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("nats connected", "url", config.MaskURL(nc.ConnectedUrl())) }),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) { logAsyncError(log, sub, err) }),
	}
	nc, err := nats.Connect(url, append(opts, broker.UserOptions(user, password)...)...)
	if err != nil {
		return nil, fmt.Errorf("connect to nats %s as %s: %w", masked, user, err)
	}
	return nc, nil
}

// violationSubject finds the subject in the server's permissions error
// ("Permissions Violation for Publish to \"orders.x\" …"), for the log.
var violationSubject = regexp.MustCompile(`(?:Publish|Subscription) to "([^"]*)"`)

// logAsyncError logs an error the server sent outside any request: a
// permissions violation at ERROR, with its subject (a bug, or a service
// configured with another's user: an operator must see it), anything else
// (a slow consumer) at WARN.
func logAsyncError(log *slog.Logger, sub *nats.Subscription, err error) {
	if !errors.Is(err, nats.ErrPermissionViolation) {
		log.Warn("nats error", "err", err)
		return
	}
	subject := ""
	if m := violationSubject.FindStringSubmatch(err.Error()); m != nil {
		subject = m[1]
	} else if sub != nil {
		subject = sub.Subject
	}
	log.Error("nats permissions violation", "subject", subject, "err", err)
}

// shopSettled waits until the shop has taken in what was just written:
// every outbox published (an event still in its outbox is in no stream, so
// no consumer could be behind on it yet), then every durable consumer of
// the registry with nothing left to settle (no message pending or awaiting
// its ack). The demo's banner must not invite an order for a SKU the order
// service has not read yet. A consumer not created yet counts as
// unsettled. It gives up with an error after a minute, or when ctx ends;
// with no JetStream to ask (no audit connection) it returns at once.
func shopSettled(ctx context.Context, cfg config.Config, js jetstream.JetStream) error {
	if js == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	shop, closePools, err := OpenShop(ctx, cfg.Schemas(), ShopPoolSize)
	if err != nil {
		return err
	}
	defer closePools()
	published := func() bool {
		for _, pool := range shop.Pools {
			st, err := outbox.ReadStats(ctx, pool)
			if err != nil || st.Pending > 0 {
				return false
			}
		}
		return true
	}
	consumed := func() bool {
		for _, e := range cfg.Registry {
			for _, c := range e.Consumers {
				cons, err := js.Consumer(ctx, c.Stream, c.Name)
				if err != nil {
					return false
				}
				info, err := cons.Info(ctx)
				if err != nil || info.NumPending > 0 || info.NumAckPending > 0 {
					return false
				}
			}
		}
		return true
	}
	for _, done := range []func() bool{published, consumed} {
		for !done() {
			select {
			case <-ctx.Done():
				return fmt.Errorf("the shop has not taken in what was written: %w", ctx.Err())
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	return nil
}
