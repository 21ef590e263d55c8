package app

import (
	"cmp"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"strings"

	"github.com/shop-ref/shop/migrations"
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
	// Services holds each service's own settings, by service name.
	Services map[string]*ServiceConfig
}

// ServiceConfig is what differs between services.
type ServiceConfig struct {
	// DatabaseURL overrides Config.DatabaseURL for this service
	// (ORDER_DATABASE_URL, INVENTORY_DATABASE_URL, …).
	DatabaseURL string
	// Addr is the HTTP listen address (ORDER_ADDR, …; :8081 to :8084).
	Addr string
}

// LoadConfig reads the configuration from getenv (os.Getenv in main).
func LoadConfig(getenv func(string) string) Config {
	cfg := Config{
		DatabaseURL: cmp.Or(getenv("DATABASE_URL"), DefaultDatabaseURL),
		NATSURL:     getenv("NATS_URL"),
		Services:    make(map[string]*ServiceConfig, len(migrations.Services)),
	}
	for _, name := range migrations.Services {
		prefix := strings.ToUpper(name)
		cfg.Services[name] = &ServiceConfig{
			DatabaseURL: getenv(prefix + "_DATABASE_URL"),
			Addr:        cmp.Or(getenv(prefix+"_ADDR"), defaultAddrs[name]),
		}
	}
	return cfg
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
	}
	for _, name := range migrations.Services {
		sc := cfg.Services[name]
		group := []any{slog.String("addr", sc.Addr)}
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
