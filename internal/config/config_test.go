package config

import (
	"flag"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/services"
	"github.com/shop-ref/shop/services/payment"
)

func TestConfig(t *testing.T) {
	t.Parallel()

	t.Run("defaults are the contract's", func(t *testing.T) {
		t.Parallel()
		cfg, err := LoadConfig(func(string) string { return "" })
		if err != nil {
			t.Fatal(err)
		}
		if cfg.DatabaseURL != DefaultDatabaseURL || cfg.NATSURL != "" {
			t.Errorf("DatabaseURL %q, NATSURL %q", cfg.DatabaseURL, cfg.NATSURL)
		}
		pay, reserve := setting[time.Duration](cfg, "PAYMENT_TIMEOUT"), setting[time.Duration](cfg, "ORDER_RESERVATION_TIMEOUT")
		if pay != 15*time.Minute || reserve != 5*time.Minute {
			t.Errorf("PAYMENT_TIMEOUT %s, ORDER_RESERVATION_TIMEOUT %s; want 15m and 5m", pay, reserve)
		}
		if fake, token := setting[bool](cfg, "PAYMENT_FAKE_PROVIDER"), setting[string](cfg, "OPERATOR_TOKEN"); fake || token != "" {
			t.Errorf("PAYMENT_FAKE_PROVIDER %v, OPERATOR_TOKEN set %v; want the demo's endpoint off and no token", fake, token != "")
		}
		if got := setting[string](cfg, "PAYMENT_WEBHOOK_SECRET"); got != payment.DefaultWebhookSecret {
			t.Errorf("PAYMENT_WEBHOOK_SECRET %q, want the demo's default", got)
		}
		if got := cfg.Services["order"].Addr; got != ":8081" {
			t.Errorf("order addr %q, want the contract's :8081", got)
		}
		// The dashboard shows customers' orders: loopback unless asked,
		// and read-only outside the demo.
		if cfg.DashboardAddr != "127.0.0.1:8080" || cfg.DashboardDemo || len(cfg.DashboardHosts) != 0 {
			t.Errorf("dashboard: addr %q, demo %v, hosts %q; want 127.0.0.1:8080, read-only, none", cfg.DashboardAddr, cfg.DashboardDemo, cfg.DashboardHosts)
		}
		for _, e := range services.All {
			if got := cfg.Services[e.Name].Addr; got != e.Addr {
				t.Errorf("%s addr %q, want its entry's %q", e.Name, got, e.Addr)
			}
			if got := cfg.DatabaseURLOf(e.Name); got != DefaultDatabaseURL {
				t.Errorf("%s database %q, want the shared default", e.Name, got)
			}
		}
	})

	t.Run("a service's own database overrides the shared one", func(t *testing.T) {
		t.Parallel()
		env := map[string]string{
			"DATABASE_URL":         "postgres://a@h/shared",
			"PAYMENT_DATABASE_URL": "postgres://a@h/payments",
			"PAYMENT_ADDR":         ":9000",
		}
		cfg, err := LoadConfig(func(k string) string { return env[k] })
		if err != nil {
			t.Fatal(err)
		}
		if got := cfg.DatabaseURLOf("payment"); got != "postgres://a@h/payments" {
			t.Errorf("payment database %q", got)
		}
		if got := cfg.DatabaseURLOf("order"); got != "postgres://a@h/shared" {
			t.Errorf("order database %q", got)
		}
		if got := cfg.Services["payment"].Addr; got != ":9000" {
			t.Errorf("payment addr %q", got)
		}
	})

	t.Run("the dashboard's demo and hosts", func(t *testing.T) {
		t.Parallel()
		env := map[string]string{"DASHBOARD_DEMO": "true", "DASHBOARD_HOSTS": " shop.example, ops.example ,,"}
		cfg, err := LoadConfig(func(k string) string { return env[k] })
		if err != nil {
			t.Fatal(err)
		}
		if !cfg.DashboardDemo || !slices.Equal(cfg.DashboardHosts, []string{"shop.example", "ops.example"}) {
			t.Errorf("demo %v, hosts %q", cfg.DashboardDemo, cfg.DashboardHosts)
		}
	})

	t.Run("flags override the environment", func(t *testing.T) {
		t.Parallel()
		env := map[string]string{"DATABASE_URL": "postgres://env@h/db", "ORDER_ADDR": ":7000", "NATS_URL": "nats://env:4222"}
		cfg, err := LoadConfig(func(k string) string { return env[k] })
		if err != nil {
			t.Fatal(err)
		}
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		cfg.RegisterFlags(fs)
		if err := fs.Parse([]string{"-database-url", "postgres://flag@h/db", "-order-addr", ":7001", "-order-reservation-timeout", "90s"}); err != nil {
			t.Fatal(err)
		}
		if cfg.DatabaseURL != "postgres://flag@h/db" || cfg.Services["order"].Addr != ":7001" || cfg.NATSURL != "nats://env:4222" {
			t.Errorf("after flags: %+v, order addr %q", cfg, cfg.Services["order"].Addr)
		}
		if got := setting[time.Duration](cfg, "ORDER_RESERVATION_TIMEOUT"); got != 90*time.Second {
			t.Errorf("after flags: ORDER_RESERVATION_TIMEOUT %s, want 90s", got)
		}
	})

	t.Run("help and logs never show a password", func(t *testing.T) {
		t.Parallel()
		env := map[string]string{
			"DATABASE_URL":           "postgres://shop:s3cret@db:5432/shop",
			"ORDER_DATABASE_URL":     "host=db user=shop password=s3cret dbname=orders",
			"NATS_URL":               "nats://relay:s3cret@nats:4222",
			"OPERATOR_TOKEN":         "s3cret",
			"PAYMENT_WEBHOOK_SECRET": "s3cret",
		}
		cfg, err := LoadConfig(func(k string) string { return env[k] })
		if err != nil {
			t.Fatal(err)
		}
		var help strings.Builder
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		fs.SetOutput(&help)
		cfg.RegisterFlags(fs)
		fs.PrintDefaults()
		logged := cfg.LogValue().String()
		for what, s := range map[string]string{"help": help.String(), "log": logged} {
			if strings.Contains(s, "s3cret") {
				t.Errorf("%s shows the password: %s", what, s)
			}
		}
		if !strings.Contains(logged, "db:5432") {
			t.Errorf("log hides more than the password: %s", logged)
		}
	})
}

func TestMaskURL(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"postgres://postgres:postgres@127.0.0.1:5432/shop?sslmode=disable": "postgres://postgres:xxxxx@127.0.0.1:5432/shop?sslmode=disable",
		"postgres://u@h/db?password=s3cret":                                "postgres://u@h/db?password=xxxxx",
		"postgres://u@h/db":                                                "postgres://u@h/db",
		"host=h password='a b' dbname=x":                                   "host=h password=xxxxx dbname=x",
		"host=h password=s3cret":                                           "host=h password=xxxxx",
		"nats://127.0.0.1:4222":                                            "nats://127.0.0.1:4222",
		"":                                                                 "",
	} {
		if got := MaskURL(in); got != want {
			t.Errorf("MaskURL(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestLoadConfigRefusesBadValues(t *testing.T) {
	for k, v := range map[string]string{
		"PAYMENT_TIMEOUT":           "soon",
		"ORDER_RESERVATION_TIMEOUT": "0s",
		"FULFILLMENT_DELAY":         "-2s",
		"IDEMPOTENCY_KEY_TTL":       "0",
		"PAYMENT_FAKE_PROVIDER":     "yes please",
		"DASHBOARD_DEMO":            "on",
		"NATS_REPLICAS":             "7",
		"RELAY_MODE":                "wal",
		"INVENTORY_RELAY_MODE":      "debezium",
	} {
		_, err := LoadConfig(func(name string) string {
			if name == k {
				return v
			}
			return ""
		})
		if err == nil || !strings.Contains(err.Error(), k) {
			t.Errorf("%s=%q: err = %v, want an error naming %s", k, v, err, k)
		}
	}
}

// RELAY_MODE sets every service's relay mode, <NAME>_RELAY_MODE one
// service's over it, and nothing set is DefaultRelayMode.
func TestRelayMode(t *testing.T) {
	t.Parallel()
	load := func(env map[string]string) Config {
		t.Helper()
		cfg, err := LoadConfig(func(k string) string { return env[k] })
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	for _, name := range services.All.Names() {
		if got := load(nil).Services[name].RelayMode; got != DefaultRelayMode {
			t.Errorf("nothing set: %s's relay mode = %q, want DefaultRelayMode %q", name, got, DefaultRelayMode)
		}
	}
	cfg := load(map[string]string{"RELAY_MODE": "poll", "PAYMENT_RELAY_MODE": "CDC"})
	for _, name := range services.All.Names() {
		want := outbox.ModePoll
		if name == "payment" {
			want = outbox.ModeCDC
		}
		if got := cfg.Services[name].RelayMode; got != want {
			t.Errorf("RELAY_MODE=poll PAYMENT_RELAY_MODE=CDC: %s's relay mode = %q, want %q", name, got, want)
		}
	}
	if !strings.Contains(cfg.LogValue().String(), "relay_mode=cdc") {
		t.Errorf("the configuration's log %s does not show the relay mode", cfg.LogValue())
	}
}

// A variable for a service the registry lacks (its package left out of
// services.All) is found, with the service it names; the shop's own
// variables and the registered services' are not.
func TestUnknownServiceVars(t *testing.T) {
	t.Parallel()
	environ := []string{"NOSUCHSERVICE_ADDR=:8090", "NOSUCHSERVICE_DATABASE_URL=postgres://x", "ORDER_ADDR=:8081",
		"DASHBOARD_ADDR=:8080", "AUDIT_NATS_PASSWORD=x", "STREAMS_NATS_PASSWORD=x", "PAYMENT_NATS_PASSWORD=x",
		"DATABASE_URL=postgres://y", "NATS_URL=nats://z", "HOME=/root", "OTEL_EXPORTER_OTLP_ENDPOINT=http://j:4318",
		"RELAY_MODE=poll", "ORDER_RELAY_MODE=cdc", "NOSUCHSERVICE_RELAY_MODE=cdc"}
	got := UnknownServiceVars(services.All, environ)
	want := []UnknownVar{{"NOSUCHSERVICE_ADDR", "nosuchservice"}, {"NOSUCHSERVICE_DATABASE_URL", "nosuchservice"},
		{"NOSUCHSERVICE_RELAY_MODE", "nosuchservice"}}
	if !slices.Equal(got, want) {
		t.Errorf("UnknownServiceVars = %v, want %v", got, want)
	}
}

// LoadConfig is LoadFor of the shop's own services, for the tests of this
// package. Only cmd/shop wires services.All into the code that runs
// (services/imports_test.go holds that rule); tests may use it.
func LoadConfig(getenv func(string) string) (Config, error) {
	return LoadFor(services.All, getenv)
}

// setting is Setting of cfg's settings.
func setting[T any](cfg Config, env string) T { return Setting[T](cfg.Settings, env) }
