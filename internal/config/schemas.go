package config

import (
	"cmp"
	"flag"
	"fmt"
	"strings"

	"github.com/shop-ref/shop/internal/registry"
)

// Schemas is where the schema of each service of Registry lives: all that
// the commands which only read or migrate the schemas (shop migrate,
// verify, outbox, trace) need of the configuration, and what OpenShop
// opens (app.OpenShop). Config.Schemas is a running shop's.
type Schemas struct {
	Registry registry.Registry
	// DatabaseURL is the database of every service without its own
	// (DATABASE_URL, default DefaultDatabaseURL).
	DatabaseURL string
	// Own is each service's own database URL, by name
	// (<SERVICE>_DATABASE_URL); "" or absent: DatabaseURL.
	Own map[string]string
}

// LoadSchemas reads the Schemas of reg's services from getenv: the same
// variables LoadFor reads for them, and no others, so a setting the
// command does not use cannot stop it.
func LoadSchemas(reg registry.Registry, getenv func(string) string) (Schemas, error) {
	if err := reg.Validate(); err != nil {
		return Schemas{}, fmt.Errorf("the service registry: %w", err)
	}
	s := Schemas{Registry: reg, DatabaseURL: cmp.Or(getenv("DATABASE_URL"), DefaultDatabaseURL), Own: make(map[string]string, len(reg))}
	for _, e := range reg {
		s.Own[e.Name] = getenv(strings.ToUpper(e.Name) + "_DATABASE_URL")
	}
	return s, nil
}

// Schemas is the part of cfg that says where each service's schema is.
func (cfg Config) Schemas() Schemas {
	s := Schemas{Registry: cfg.Registry, DatabaseURL: cfg.DatabaseURL, Own: make(map[string]string, len(cfg.Services))}
	for name, sc := range cfg.Services {
		s.Own[name] = sc.DatabaseURL
	}
	return s
}

// DatabaseURLOf returns the database URL of service: its own, else the
// shared one.
func (s Schemas) DatabaseURLOf(service string) string {
	return cmp.Or(s.Own[service], s.DatabaseURL)
}

// RegisterFlags adds the flags of the database URLs to fs, named as
// Config.RegisterFlags names them, defaulting to the values s has now.
func (s *Schemas) RegisterFlags(fs *flag.FlagSet) {
	fs.Var(secretFlag{&s.DatabaseURL}, "database-url", "database of every service without its own `URL` (DATABASE_URL)")
	for _, name := range s.Registry.Names() {
		fs.Var(ownURLFlag{s.Own, name}, name+"-database-url",
			fmt.Sprintf("database `URL` of the %s service (%s_DATABASE_URL)", name, strings.ToUpper(name)))
	}
}

// ownURLFlag is the flag of one service's database URL in Schemas.Own,
// shown masked in -h as secretFlag is.
type ownURLFlag struct {
	own     map[string]string
	service string
}

func (f ownURLFlag) String() string {
	if f.own == nil {
		return ""
	}
	return MaskURL(f.own[f.service])
}

func (f ownURLFlag) Set(v string) error { f.own[f.service] = v; return nil }

// SecretVar defines a string flag whose default -h shows masked (a URL
// with a password), for the commands that register a few settings of
// their own rather than a whole Config's.
func SecretVar(fs *flag.FlagSet, p *string, name, usage string) {
	fs.Var(secretFlag{p}, name, usage)
}

// LoadSettings reads the services' own settings (PAYMENT_TIMEOUT, …) of
// reg from getenv, as LoadFor does, for a command that reads some of
// them without running the services: shop verify -repair, the saga's
// timeouts.
func LoadSettings(reg registry.Registry, getenv func(string) string) (*registry.Env, error) {
	if err := reg.Validate(); err != nil {
		return nil, fmt.Errorf("the service registry: %w", err)
	}
	env := registry.NewEnv(getenv)
	for _, e := range reg {
		e.Configure(env) // declares its settings; the constructor it returns is not needed
	}
	if err := env.Err(); err != nil {
		return nil, err
	}
	return env, nil
}
