package app

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
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/services/order"
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
)

var defaultAddrs = map[string]string{
	"order":       ":8081",
	"inventory":   ":8082",
	"payment":     ":8083",
	"fulfillment": ":8084",
}

// Config is the configuration of one shop process, read from the
// environment once by LoadConfig; the flags of RegisterFlags override it.
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
	// reconciler of `shop all` read the streams with (AUDIT_NATS_PASSWORD).
	// Empty: anonymous, or, for the local demo's embedded server, the
	// password it wrote (DemoAuditPasswordFile).
	AuditNATSPassword string
	// Services holds each service's own settings, by service name.
	Services map[string]*ServiceConfig

	// PaymentTimeout is how long an order may wait in WAIT_PAY before the
	// saga closes it (PAYMENT_TIMEOUT, default 15m).
	PaymentTimeout time.Duration
	// ReservationTimeout is how long an order may stay PENDING, inventory
	// not answering, before the saga closes it (ORDER_RESERVATION_TIMEOUT,
	// default order.DefaultReservationTimeout, 5m).
	ReservationTimeout time.Duration
	// WebhookSecret is the HMAC key of payment provider callbacks
	// (PAYMENT_WEBHOOK_SECRET, default DefaultWebhookSecret, with a warning).
	WebhookSecret string
	// FakeProvider switches on the payment service's demo endpoint POST
	// /payments/{id}/simulate, where the built-in fake provider charges an
	// order and signs its callback (PAYMENT_FAKE_PROVIDER, default false;
	// `shop all -demo` turns it on).
	FakeProvider bool
	// OperatorToken is the bearer token the operator's endpoints (PUT
	// /stock/{sku}) require (OPERATOR_TOKEN). Empty, the default: they are
	// open, and the inventory service warns.
	OperatorToken string
	// FulfillmentDelay is how long after FulfillmentStarted the simulated
	// carrier delivers (FULFILLMENT_DELAY, default 2s).
	FulfillmentDelay time.Duration
	// IdempotencyKeyTTL is how long the order service remembers an
	// Idempotency-Key (IDEMPOTENCY_KEY_TTL, default 24h).
	IdempotencyKeyTTL time.Duration
	// OrderMaxBacklog is how many events the saga's consumers may have left
	// to settle before POST /orders answers 503 with Retry-After
	// (ORDER_MAX_BACKLOG, default 1000; 0: never shed).
	OrderMaxBacklog int64
	// NATSReplicas is how many copies JetStream keeps of each stream
	// (NATS_REPLICAS, default 1): 3 on a three-node cluster.
	NATSReplicas int
	// StreamLimits bound each stream: NATS_STREAM_MAX_AGE (default 8 days,
	// at least the outboxes' retention and the inboxes' replay window) and
	// NATS_STREAM_MAX_BYTES (default 0: no bound; a full stream refuses new
	// messages and the relays wait).
	StreamLimits broker.Limits
	// DashboardAddr is where `shop all` serves the live dashboard
	// (DASHBOARD_ADDR, default :8080).
	DashboardAddr string
	// TracesEndpoint is where traces go over OTLP/HTTP
	// (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT).
	// Set, each service of the process gets a tracer provider of its own
	// that exports there, honouring the other standard OTEL_* variables;
	// empty, the default: no spans, nothing exported. A ServiceConfig's
	// own TracerProvider takes precedence.
	TracesEndpoint string
}

// DefaultWebhookSecret is the demo's webhook key. Anyone who reads this
// repository can sign callbacks with it, so a process using it warns.
const DefaultWebhookSecret = "dev-secret"

// ServiceConfig is what differs between services.
type ServiceConfig struct {
	// DatabaseURL overrides Config.DatabaseURL for this service
	// (ORDER_DATABASE_URL, INVENTORY_DATABASE_URL, …).
	DatabaseURL string
	// Addr is the HTTP listen address (ORDER_ADDR, …; :8081 to :8084).
	Addr string
	// TracerProvider, when set, makes the service's spans instead of the
	// provider Config.TracesEndpoint would make: tests and embedders pass
	// their own. It is never shut down by the service.
	TracerProvider trace.TracerProvider
	// NATSPassword is the password of the service's own NATS user, named
	// after the service (ORDER_NATS_PASSWORD, …; broker.Services). Empty:
	// it connects anonymously, with a warning, as an unsecured server
	// allows. The embedded server of `shop all` ignores it and makes its
	// own.
	NATSPassword string
}

// LoadConfig reads the configuration from getenv (os.Getenv in main). It
// fails only on a value it cannot parse.
func LoadConfig(getenv func(string) string) (Config, error) {
	cfg := Config{
		DatabaseURL:       cmp.Or(getenv("DATABASE_URL"), DefaultDatabaseURL),
		NATSURL:           getenv("NATS_URL"),
		AuditNATSPassword: getenv(broker.PasswordVar(broker.AuditUser)),
		Services:          make(map[string]*ServiceConfig, len(migrations.Services)),
		WebhookSecret:     cmp.Or(getenv("PAYMENT_WEBHOOK_SECRET"), DefaultWebhookSecret),
		OperatorToken:     getenv("OPERATOR_TOKEN"),
		NATSReplicas:      1,
		StreamLimits:      broker.DefaultLimits,
		DashboardAddr:     cmp.Or(getenv("DASHBOARD_ADDR"), ":8080"),
		// Read here only to know whether to export: the exporter reads
		// these and the other OTEL_* variables itself, as specified.
		TracesEndpoint: cmp.Or(getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), getenv("OTEL_EXPORTER_OTLP_ENDPOINT")),
	}
	cfg.OrderMaxBacklog = order.DefaultMaxBacklog
	if v := getenv("ORDER_MAX_BACKLOG"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return Config{}, fmt.Errorf("ORDER_MAX_BACKLOG=%q: want a count of events, 0 to never shed orders", v)
		}
		cfg.OrderMaxBacklog = n
	}
	if v := getenv("PAYMENT_FAKE_PROVIDER"); v != "" {
		on, err := strconv.ParseBool(v)
		if err != nil {
			return Config{}, fmt.Errorf("PAYMENT_FAKE_PROVIDER=%q: want true or false", v)
		}
		cfg.FakeProvider = on
	}
	if v := getenv("NATS_STREAM_MAX_AGE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return Config{}, fmt.Errorf("NATS_STREAM_MAX_AGE=%q: want a duration such as 192h, 0 to keep messages for ever", v)
		}
		cfg.StreamLimits.MaxAge = d
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
	for _, d := range []struct {
		env string
		def time.Duration
		dst *time.Duration
	}{
		{"PAYMENT_TIMEOUT", 15 * time.Minute, &cfg.PaymentTimeout},
		{"ORDER_RESERVATION_TIMEOUT", order.DefaultReservationTimeout, &cfg.ReservationTimeout},
		{"FULFILLMENT_DELAY", 2 * time.Second, &cfg.FulfillmentDelay},
		{"IDEMPOTENCY_KEY_TTL", 24 * time.Hour, &cfg.IdempotencyKeyTTL},
	} {
		*d.dst = d.def
		if v := getenv(d.env); v != "" {
			parsed, err := time.ParseDuration(v)
			if err != nil || parsed <= 0 {
				return Config{}, fmt.Errorf("%s=%q: want a positive duration such as 15m or 2s", d.env, v)
			}
			*d.dst = parsed
		}
	}
	for _, name := range migrations.Services {
		prefix := strings.ToUpper(name)
		if defaultAddrs[name] == "" {
			// Without one it would listen on a random port, and nothing
			// (compose, the demo's seeding, the dashboard) would find it.
			return Config{}, fmt.Errorf("service %q has no default HTTP address: add it to defaultAddrs in internal/app/config.go", name)
		}
		cfg.Services[name] = &ServiceConfig{
			DatabaseURL:  getenv(prefix + "_DATABASE_URL"),
			Addr:         cmp.Or(getenv(prefix+"_ADDR"), defaultAddrs[name]),
			NATSPassword: getenv(broker.PasswordVar(name)),
		}
	}
	return cfg, nil
}

// EnvVars lists every environment variable LoadConfig reads, in the order it
// reads them. It is derived from LoadConfig itself, run once with an
// environment that records each name and answers empty, so the list cannot
// drift from what the code reads. That holds as long as LoadConfig reads
// every variable unconditionally (none only when another is set): keep it so.
func EnvVars() []string {
	var names []string
	_, _ = LoadConfig(func(name string) string { // empty values never fail
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
		return ""
	})
	return names
}

// RegisterFlags adds a flag for every setting to fs, defaulting to the value
// cfg has now, so that a flag given on the command line wins over the
// environment.
func (cfg *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.Var(secretFlag{&cfg.DatabaseURL}, "database-url", "database of every service without its own `URL` (DATABASE_URL)")
	fs.Var(secretFlag{&cfg.NATSURL}, "nats-url", "NATS server `URL` (NATS_URL); empty: shop all embeds one, a single service uses "+DefaultNATSURL)
	for _, name := range migrations.Services {
		sc, env := cfg.Services[name], strings.ToUpper(name)
		fs.Var(secretFlag{&sc.DatabaseURL}, name+"-database-url", fmt.Sprintf("database `URL` of the %s service (%s_DATABASE_URL)", name, env))
		fs.StringVar(&sc.Addr, name+"-addr", sc.Addr, fmt.Sprintf("HTTP listen `address` of the %s service (%s_ADDR)", name, env))
	}
	fs.DurationVar(&cfg.PaymentTimeout, "payment-timeout", cfg.PaymentTimeout, "how long an order may wait for payment (PAYMENT_TIMEOUT)")
	fs.DurationVar(&cfg.ReservationTimeout, "order-reservation-timeout", cfg.ReservationTimeout, "how long an order may wait for inventory to reserve it (ORDER_RESERVATION_TIMEOUT)")
	fs.Var(maskedFlag{&cfg.WebhookSecret}, "payment-webhook-secret", "HMAC `key` of payment callbacks (PAYMENT_WEBHOOK_SECRET)")
	fs.BoolVar(&cfg.FakeProvider, "payment-fake-provider", cfg.FakeProvider, "serve POST /payments/{id}/simulate, the fake provider's demo payments (PAYMENT_FAKE_PROVIDER)")
	fs.Var(maskedFlag{&cfg.OperatorToken}, "operator-token", "bearer `token` the operator endpoints require, PUT /stock/{sku}; empty: open (OPERATOR_TOKEN)")
	fs.DurationVar(&cfg.FulfillmentDelay, "fulfillment-delay", cfg.FulfillmentDelay, "shipment start to delivery (FULFILLMENT_DELAY)")
	fs.IntVar(&cfg.NATSReplicas, "nats-replicas", cfg.NATSReplicas, "copies JetStream keeps of each stream (NATS_REPLICAS)")
	fs.DurationVar(&cfg.StreamLimits.MaxAge, "nats-stream-max-age", cfg.StreamLimits.MaxAge, "how long each stream keeps a message; 0: for ever (NATS_STREAM_MAX_AGE)")
	fs.Int64Var(&cfg.StreamLimits.MaxBytes, "nats-stream-max-bytes", cfg.StreamLimits.MaxBytes, "bound of each stream's size; 0: none (NATS_STREAM_MAX_BYTES)")
	fs.StringVar(&cfg.DashboardAddr, "dashboard-addr", cfg.DashboardAddr, "HTTP listen `address` of the dashboard of shop all (DASHBOARD_ADDR)")
	fs.Int64Var(&cfg.OrderMaxBacklog, "order-max-backlog", cfg.OrderMaxBacklog, "saga events waiting for consumers above which POST /orders is 503; 0: never (ORDER_MAX_BACKLOG)")
	fs.DurationVar(&cfg.IdempotencyKeyTTL, "idempotency-key-ttl", cfg.IdempotencyKeyTTL, "how long Idempotency-Keys are remembered (IDEMPOTENCY_KEY_TTL)")
}

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
		slog.Duration("payment_timeout", cfg.PaymentTimeout),
		slog.Duration("reservation_timeout", cfg.ReservationTimeout),
		slog.Duration("fulfillment_delay", cfg.FulfillmentDelay),
		slog.Bool("default_webhook_secret", cfg.WebhookSecret == DefaultWebhookSecret),
		slog.Bool("fake_provider", cfg.FakeProvider),
		slog.Bool("operator_token_set", cfg.OperatorToken != ""),
		slog.Bool("audit_nats_password_set", cfg.AuditNATSPassword != ""),
	}
	for _, name := range migrations.Services {
		sc := cfg.Services[name]
		group := []any{slog.String("addr", sc.Addr), slog.Bool("nats_password_set", sc.NATSPassword != "")}
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

// maskedFlag is a secret string flag: -h never shows its value.
type maskedFlag struct{ p *string }

func (f maskedFlag) String() string {
	if f.p == nil || *f.p == "" {
		return ""
	}
	return "xxxxx"
}

func (f maskedFlag) Set(s string) error { *f.p = s; return nil }
