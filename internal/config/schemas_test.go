package config

import (
	"flag"
	"io"
	"maps"
	"testing"

	"github.com/shop-ref/shop/services"
)

// The commands that take only Schemas read the database URLs as the
// services do: LoadSchemas and LoadFor's Schemas agree, and a flag
// overrides its variable.
func TestSchemasAreTheConfigsDatabases(t *testing.T) {
	env := map[string]string{
		"DATABASE_URL":         "postgres://a@db:5432/shop",
		"PAYMENT_DATABASE_URL": "postgres://p:secret@db:5432/shop",
		"PAYMENT_TIMEOUT":      "not a duration", // not a schema's business
	}
	getenv := func(k string) string { return env[k] }
	s, err := LoadSchemas(services.All, getenv)
	if err != nil {
		t.Fatal(err)
	}
	delete(env, "PAYMENT_TIMEOUT")
	cfg, err := LoadFor(services.All, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if want := cfg.Schemas(); s.DatabaseURL != want.DatabaseURL || !maps.Equal(s.Own, want.Own) {
		t.Errorf("LoadSchemas = %+v, the configuration's = %+v", s, want)
	}
	for _, name := range services.All.Names() {
		if got, want := s.DatabaseURLOf(name), cfg.DatabaseURLOf(name); got != want {
			t.Errorf("DatabaseURLOf(%s) = %q, the configuration's %q", name, got, want)
		}
	}

	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	s.RegisterFlags(fs)
	if err := fs.Parse([]string{"-order-database-url", "postgres://o@db2:5432/shop"}); err != nil {
		t.Fatal(err)
	}
	if got := s.DatabaseURLOf("order"); got != "postgres://o@db2:5432/shop" {
		t.Errorf("after -order-database-url, DatabaseURLOf(order) = %q", got)
	}
	if got := fs.Lookup("payment-database-url").DefValue; got != MaskURL(env["PAYMENT_DATABASE_URL"]) {
		t.Errorf("-h shows payment's database URL as %q, want it masked", got)
	}
}
