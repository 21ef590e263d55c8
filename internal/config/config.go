// Package config is the configuration of a shop process: what it reads
// from the environment once at start-up (LoadFor) and the flags that
// override it, for the services of the registry cmd/shop passes, and the
// smaller parts that commands which do not run the services take
// (Schemas, the services' settings).
package config

import (
	"cmp"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Defaults of the contract's configuration.
const (
	DefaultDatabaseURL = "postgres://postgres:postgres@127.0.0.1:5432/shop?sslmode=disable"
	// DefaultNATSURL is where a single service looks for NATS when NATS_URL is
	// empty: the server that `shop all` embeds, or any local one.
	DefaultNATSURL = "nats://127.0.0.1:4222"
	// EmbeddedNATSDir is where the embedded NATS server of `shop all` keeps
	// its streams.
	EmbeddedNATSDir = "./data/nats"
	// ReconcileInterval is RECONCILE_INTERVAL's default: how often the
	// reconciler runs.
	ReconcileInterval = time.Minute
	// DefaultRelayMode is RELAY_MODE's default: how every service's outbox
	// relay finds its events when neither RELAY_MODE nor the service's own
	// <NAME>_RELAY_MODE says. In one place so that the figures of `make
	// bench` can flip it (docs/architecture.md).
	DefaultRelayMode = outbox.ModeCDC
	// DefaultDashboardAddr is DASHBOARD_ADDR's default: loopback only, so
	// that the dashboard, which shows every customer's recent orders, is
	// not on every interface unless asked (docker-compose.yml asks).
	DefaultDashboardAddr = "127.0.0.1:8080"
)

// Config is the configuration of one shop process, read from the
// environment once by LoadFor; the flags of RegisterFlags override it.
// Its LogValue masks passwords, so it can be logged whole.
type Config struct {
	// DatabaseURL is the database of every service without its own
	// (DATABASE_URL). Each service keeps its tables in its own schema there.
	DatabaseURL string
	// NATSURL is the NATS server or cluster (NATS_URL). Empty: `shop all`
	// embeds a server, a single service uses DefaultNATSURL.
	NATSURL string
	// AuditNATSPassword is the password of the NATS audit user
	// (broker.AuditUser) that `shop verify`, `shop outbox` and the
	// reconciler read the streams with (AUDIT_NATS_PASSWORD). Empty:
	// anonymous, or, for the local demo's embedded server, the password it
	// wrote (app.DemoAuditPasswordFile).
	AuditNATSPassword string
	// StreamsNATSPassword is the password of the stream keeper's NATS user
	// (broker.StreamsUser), the only one that may update a stream
	// (STREAMS_NATS_PASSWORD). Set, the process runs the stream keeper:
	// every stream whose configuration drifted from the shop's is restored
	// within a stream check (10 s). Empty: each service only reports the drift
	// of its own stream. The embedded server of `shop all` ignores it and
	// makes its own.
	StreamsNATSPassword string
	// Registry is the shop's services (services.All; a test may add one).
	Registry registry.Registry
	// Services holds what differs between services, by service name.
	Services map[string]*ServiceConfig
	// Settings are the services' own settings (PAYMENT_TIMEOUT, …), each
	// declared by its service's registry entry.
	Settings *registry.Env
	// build is each service's constructor, bound to its settings.
	build map[string]registry.NewFunc
	// Test holds what only tests change.
	Test struct {
		// StreamCheck, when set, replaces how often each service looks for
		// its missing streams and the stream keeper for drift (10 s).
		StreamCheck time.Duration
	}

	// NATSReplicas is how many copies JetStream keeps of each stream
	// (NATS_REPLICAS, default 1): 3 on a three-node cluster.
	NATSReplicas int
	// StreamLimits bound each stream: NATS_STREAM_MAX_AGE (default 8 days,
	// at least the outboxes' retention and the inboxes' replay window) and
	// NATS_STREAM_MAX_BYTES (default 0: no bound; a full stream refuses new
	// messages and the relays wait).
	StreamLimits broker.Limits
	// ReconcileInterval is how often the reconciler runs where the order
	// service does (RECONCILE_INTERVAL, default ReconcileInterval).
	ReconcileInterval time.Duration
	// DashboardAddr is where `shop all` and `shop dashboard` serve the live
	// dashboard (DASHBOARD_ADDR, default DefaultDashboardAddr).
	DashboardAddr string
	// DashboardDemo lets the dashboard place and pay orders
	// (DASHBOARD_DEMO, default false; `shop all -demo` sets it). Off, it
	// only reads.
	DashboardDemo bool
	// DashboardHosts are the host names the dashboard answers to besides
	// loopback's and its listen address's (DASHBOARD_HOSTS, comma
	// separated): the names an operator's browser reaches it by. A request
	// with any other Host is refused, against DNS rebinding.
	DashboardHosts []string
	// TracesEndpoint is where traces go over OTLP/HTTP
	// (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT).
	// Set, each service of the process gets a tracer provider of its own
	// that exports there, honouring the other standard OTEL_* variables;
	// empty, the default: no spans, nothing exported. A ServiceConfig's
	// own TracerProvider takes precedence.
	TracesEndpoint string
	// TraceUIURL links each order on the dashboard to its trace
	// (TRACE_UI_URL): a URL template with {trace_id}, such as
	// http://localhost:16686/trace/{trace_id} for Jaeger. Empty: no links.
	TraceUIURL string
}

// ServiceConfig is what differs between services.
type ServiceConfig struct {
	// DatabaseURL overrides Config.DatabaseURL for this service
	// (ORDER_DATABASE_URL, INVENTORY_DATABASE_URL, …).
	DatabaseURL string
	// Addr is the HTTP listen address (ORDER_ADDR, …; default the entry's
	// Addr, :8081 to :8084).
	Addr string
	// URL is the service's public base URL as another process reaches it
	// (ORDER_URL, …; default http://127.0.0.1 on Addr's port): `shop
	// dashboard` places and pays orders through the order and payment
	// services' and reads every service's /readyz there. `shop all` calls
	// its own listeners and ignores it.
	URL string
	// TracerProvider, when set, makes the service's spans instead of the
	// provider Config.TracesEndpoint would make: tests and embedders pass
	// their own. It is never shut down by the service.
	TracerProvider trace.TracerProvider
	// NATSPassword is the password of the service's own NATS user, named
	// after the service (ORDER_NATS_PASSWORD, …; its registry entry's Access). Empty:
	// it connects anonymously, with a warning, as an unsecured server
	// allows. The embedded server of `shop all` ignores it and makes its
	// own.
	NATSPassword string
	// RelayMode is how the service's outbox relay finds its events:
	// outbox.ModePoll or outbox.ModeCDC (<NAME>_RELAY_MODE, else
	// RELAY_MODE, else DefaultRelayMode). A database that cannot serve CDC
	// (wal_level, slots, the REPLICATION privilege) does not stop a service
	// in cdc mode: its relay polls, and /readyz and the log say why.
	RelayMode outbox.Mode
}

// LoadFor reads the configuration of the services of reg (services.All,
// which only cmd/shop passes; a test may add one) from getenv (os.Getenv in
// main). It fails on a value it cannot parse and on a registry entry that is
// incomplete, saying what to add.
func LoadFor(reg registry.Registry, getenv func(string) string) (Config, error) {
	if err := reg.Validate(); err != nil {
		return Config{}, fmt.Errorf("the service registry: %w", err)
	}
	cfg := Config{
		DatabaseURL:         cmp.Or(getenv("DATABASE_URL"), DefaultDatabaseURL),
		NATSURL:             getenv("NATS_URL"),
		AuditNATSPassword:   getenv(broker.PasswordVar(broker.AuditUser)),
		StreamsNATSPassword: getenv(broker.PasswordVar(broker.StreamsUser)),
		Registry:            reg,
		Services:            make(map[string]*ServiceConfig, len(reg)),
		Settings:            registry.NewEnv(getenv),
		build:               make(map[string]registry.NewFunc, len(reg)),
		NATSReplicas:        1,
		StreamLimits:        broker.DefaultLimits,
		DashboardAddr:       cmp.Or(getenv("DASHBOARD_ADDR"), DefaultDashboardAddr),
		// Read here only to know whether to export: the exporter reads
		// these and the other OTEL_* variables itself, as specified.
		TracesEndpoint: cmp.Or(getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), getenv("OTEL_EXPORTER_OTLP_ENDPOINT")),
		TraceUIURL:     getenv("TRACE_UI_URL"),
	}
	if v := getenv("DASHBOARD_DEMO"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return Config{}, fmt.Errorf("DASHBOARD_DEMO=%q: want true or false", v)
		}
		cfg.DashboardDemo = b
	}
	for h := range strings.SplitSeq(getenv("DASHBOARD_HOSTS"), ",") {
		if h = strings.TrimSpace(h); h != "" {
			cfg.DashboardHosts = append(cfg.DashboardHosts, h)
		}
	}
	if v := getenv("NATS_STREAM_MAX_AGE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return Config{}, fmt.Errorf("NATS_STREAM_MAX_AGE=%q: want a duration such as 192h, 0 to keep messages for ever", v)
		}
		cfg.StreamLimits.MaxAge = d
	}
	cfg.ReconcileInterval = ReconcileInterval
	if v := getenv("RECONCILE_INTERVAL"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return Config{}, fmt.Errorf("RECONCILE_INTERVAL=%q: want a positive duration such as 1m", v)
		}
		cfg.ReconcileInterval = d
	}
	if v := getenv("NATS_STREAM_MAX_BYTES"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return Config{}, fmt.Errorf("NATS_STREAM_MAX_BYTES=%q: want a number of bytes, 0 for no bound", v)
		}
		cfg.StreamLimits.MaxBytes = n
	}
	if v := getenv("NATS_REPLICAS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 5 {
			return Config{}, fmt.Errorf("NATS_REPLICAS=%q: want 1 to 5 (JetStream's limit), 3 on a three-node cluster", v)
		}
		cfg.NATSReplicas = n
	}
	relayMode, err := parseRelayMode("RELAY_MODE", getenv("RELAY_MODE"), DefaultRelayMode)
	if err != nil {
		return Config{}, err
	}
	for _, e := range reg {
		prefix := strings.ToUpper(e.Name)
		mode, err := parseRelayMode(prefix+"_RELAY_MODE", getenv(prefix+"_RELAY_MODE"), relayMode)
		if err != nil {
			return Config{}, err
		}
		cfg.Services[e.Name] = &ServiceConfig{
			DatabaseURL:  getenv(prefix + "_DATABASE_URL"),
			Addr:         cmp.Or(getenv(prefix+"_ADDR"), e.Addr),
			URL:          getenv(prefix + "_URL"),
			NATSPassword: getenv(broker.PasswordVar(e.Name)),
			RelayMode:    mode,
		}
		// Each service reads its own settings, here, once: a bad value
		// stops every command before anything runs.
		cfg.build[e.Name] = e.Configure(cfg.Settings)
	}
	if err := cfg.Settings.Err(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// parseRelayMode reads a relay mode variable: empty is def, anything but
// poll or cdc is refused, so that a typo does not silently run the other
// relay.
func parseRelayMode(name, v string, def outbox.Mode) (outbox.Mode, error) {
	switch m := outbox.Mode(strings.ToLower(strings.TrimSpace(v))); m {
	case "":
		return def, nil
	case outbox.ModePoll, outbox.ModeCDC:
		return m, nil
	}
	return "", fmt.Errorf("%s=%q: want %q (claim due events from the outbox table) or %q (stream the outbox's inserts from a logical replication slot)",
		name, v, outbox.ModePoll, outbox.ModeCDC)
}

// EnvVars lists every environment variable LoadFor reads for the services
// of reg, in the order it reads them. It is derived from LoadFor itself,
// run once with an environment that records each name and answers empty,
// so the list cannot drift from what the code reads. That holds as long as
// LoadFor reads every variable unconditionally (none only when another is
// set): keep it so.
func EnvVars(reg registry.Registry) []string {
	var names []string
	_, _ = LoadFor(reg, func(name string) string { // empty values never fail
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
		return ""
	})
	return names
}

// UnknownVar is a variable named like a service's own (<NAME>_ADDR,
// <NAME>_DATABASE_URL, <NAME>_NATS_PASSWORD, <NAME>_RELAY_MODE) for a service the registry does
// not have.
type UnknownVar struct {
	Var     string // LOYALTY_ADDR
	Service string // loyalty
}

// serviceVar matches the variables every service has, by its name.
var serviceVar = regexp.MustCompile(`^([A-Z][A-Z0-9]*)_(ADDR|DATABASE_URL|NATS_PASSWORD|RELAY_MODE)$`)

// UnknownServiceVars lists the variables of environ (os.Environ's
// NAME=value) that would configure a service reg does not have: what a
// service package left out of services.All leaves behind, ignored without a
// word otherwise. The shop's own variables (DASHBOARD_ADDR,
// AUDIT_NATS_PASSWORD, …) are not listed.
func UnknownServiceVars(reg registry.Registry, environ []string) []UnknownVar {
	known := map[string]bool{}
	_, _ = LoadFor(reg, func(name string) string { known[name] = true; return "" })
	var unknown []UnknownVar
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		m := serviceVar.FindStringSubmatch(name)
		if m == nil || known[name] {
			continue
		}
		if _, err := reg.Get(strings.ToLower(m[1])); err != nil {
			unknown = append(unknown, UnknownVar{Var: name, Service: strings.ToLower(m[1])})
		}
	}
	return unknown
}

// RegisterFlags adds a flag for every setting to fs, defaulting to the value
// cfg has now, so that a flag given on the command line wins over the
// environment.
func (cfg *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.Var(secretFlag{&cfg.DatabaseURL}, "database-url", "database of every service without its own `URL` (DATABASE_URL)")
	fs.Var(secretFlag{&cfg.NATSURL}, "nats-url", "NATS server `URL` (NATS_URL); empty: shop all embeds one, a single service uses "+DefaultNATSURL)
	for _, name := range cfg.Registry.Names() {
		sc, env := cfg.Services[name], strings.ToUpper(name)
		fs.Var(secretFlag{&sc.DatabaseURL}, name+"-database-url", fmt.Sprintf("database `URL` of the %s service (%s_DATABASE_URL)", name, env))
		fs.StringVar(&sc.Addr, name+"-addr", sc.Addr, fmt.Sprintf("HTTP listen `address` of the %s service (%s_ADDR)", name, env))
		fs.StringVar(&sc.URL, name+"-url", sc.URL, fmt.Sprintf("base `URL` of the %s service that shop dashboard calls (%s_URL)", name, env))
	}
	fs.IntVar(&cfg.NATSReplicas, "nats-replicas", cfg.NATSReplicas, "copies JetStream keeps of each stream (NATS_REPLICAS)")
	fs.DurationVar(&cfg.StreamLimits.MaxAge, "nats-stream-max-age", cfg.StreamLimits.MaxAge, "how long each stream keeps a message; 0: for ever (NATS_STREAM_MAX_AGE)")
	fs.Int64Var(&cfg.StreamLimits.MaxBytes, "nats-stream-max-bytes", cfg.StreamLimits.MaxBytes, "bound of each stream's size; 0: none (NATS_STREAM_MAX_BYTES)")
	fs.StringVar(&cfg.DashboardAddr, "dashboard-addr", cfg.DashboardAddr, "HTTP listen `address` of the dashboard of shop all and shop dashboard (DASHBOARD_ADDR)")
	cfg.Settings.RegisterFlags(fs)
}

// Constructor is the constructor of service, bound to its settings; nil in
// a Config not made by LoadFor.
func (cfg Config) Constructor(service string) registry.NewFunc { return cfg.build[service] }

// DatabaseURLOf returns the database URL of service: its own, else the
// shared one.
func (cfg Config) DatabaseURLOf(service string) string {
	if sc := cfg.Services[service]; sc != nil && sc.DatabaseURL != "" {
		return sc.DatabaseURL
	}
	return cfg.DatabaseURL
}

// LogValue reports the configuration with every password masked.
func (cfg Config) LogValue() slog.Value {
	attrs := []slog.Attr{
		slog.String("database_url", MaskURL(cfg.DatabaseURL)),
		slog.String("nats_url", cmp.Or(MaskURL(cfg.NATSURL), "(embedded)")),
		slog.String("otlp_traces_endpoint", cmp.Or(MaskURL(cfg.TracesEndpoint), "(none)")),
		slog.Bool("audit_nats_password_set", cfg.AuditNATSPassword != ""),
		slog.Bool("streams_nats_password_set", cfg.StreamsNATSPassword != ""),
		slog.Int("nats_replicas", cfg.NATSReplicas),
		slog.Duration("nats_stream_max_age", cfg.StreamLimits.MaxAge),
		slog.Int64("nats_stream_max_bytes", cfg.StreamLimits.MaxBytes),
		slog.String("dashboard_addr", cfg.DashboardAddr),
		slog.Bool("dashboard_demo", cfg.DashboardDemo),
		slog.Any("dashboard_hosts", cfg.DashboardHosts),
	}
	if cfg.Settings != nil {
		attrs = append(attrs, slog.Any("settings", cfg.Settings))
	}
	for _, name := range cfg.Registry.Names() {
		sc := cfg.Services[name]
		group := []any{slog.String("addr", sc.Addr), slog.Bool("nats_password_set", sc.NATSPassword != ""), slog.String("relay_mode", string(sc.RelayMode))}
		if sc.DatabaseURL != "" {
			group = append(group, slog.String("database_url", MaskURL(sc.DatabaseURL)))
		}
		attrs = append(attrs, slog.Group(name, group...))
	}
	return slog.GroupValue(attrs...)
}

var keywordPassword = regexp.MustCompile(`password\s*=\s*('(?:\\.|[^'])*'|\S+)`)

// MaskURL hides the password in a database or NATS URL (user:password@ or a
// password parameter) or in a keyword/value connection string, for logs.
func MaskURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" || u.Opaque != "" {
		return keywordPassword.ReplaceAllString(s, "password=xxxxx")
	}
	q := u.Query()
	if q.Has("password") {
		q.Set("password", "xxxxx")
		u.RawQuery = q.Encode()
	}
	return u.Redacted()
}

// secretFlag is a string flag whose default is shown masked in -h.
type secretFlag struct{ p *string }

func (f secretFlag) String() string {
	if f.p == nil {
		return ""
	}
	return MaskURL(*f.p)
}

func (f secretFlag) Set(s string) error { *f.p = s; return nil }

// Setting is the value of the services' setting env in settings (a
// time.Duration, int64, bool or string), T's zero value when no service
// declares it: for the parts of the shop that read another part's setting
// (the reconciler and the dashboard the saga's timeouts, the demo the
// operator's token).
func Setting[T any](settings *registry.Env, env string) T {
	var zero T
	if settings == nil {
		return zero
	}
	v, ok := settings.Value(env)
	if !ok {
		return zero
	}
	t, _ := v.(T)
	return t
}
