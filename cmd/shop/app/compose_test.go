package app

// `make compose-check` runs the deployment files for real (with a Docker
// engine, in CI): one build of the image, every command the file runs, the
// seed, the restarts and the teardown are proven there. These tests check
// what that run cannot see, or only slowly, against the code, in seconds
// and without an engine: docker-compose.yml (loaded with compose-go, the
// parser of Compose v2, as `docker compose` loads it) against the registry
// and the configuration (every service, variable, port and NATS user; the
// ports' variables; the relay mode), the Dockerfile, deploy/nats/*.conf
// (with nats-server's own parser: users, routes, fsync) and deploy/seed.sh
// against the demo's catalogue.

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/demo"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/services"
)

// repoRoot is where go.mod, the Dockerfile and docker-compose.yml live,
// relative to this package's directory (go test runs in it).
const repoRoot = "../../.."

// operatorCommands are the subcommands of cmd/shop (a package main, so not
// importable) that are not a service.
var operatorCommands = []string{"all", "dashboard", "migrate", "verify", "outbox", "loadgen"}

// shopCommands are the subcommands of cmd/shop: the operator commands and
// one per service of the registry (`make compose-check` runs each the file
// names).
var shopCommands = append(slices.Clone(operatorCommands), services.Deployed().Names()...)

// oneShot are the compose services that run to completion; every other one
// is long-running and must have a health check.
var oneShot = []string{"migrate", "seed"}

// composeService is what the checks need of one compose service, as
// compose-go (the parser of Compose v2) loads it: lists as strings in the
// file's short forms ("8081:8081", "nats:/data", "./x:/y:ro").
type composeService struct {
	name                                       string
	image, restart                             string
	command, entrypoint, ports, volumes, profs []string
	env                                        map[string]string
	envKeys                                    []string // sorted
	healthcheck                                []string // its test
	dependsOn                                  map[string]composeDep
}

type composeDep struct {
	condition string
	required  bool
}

// loadCompose loads docker-compose.yml with compose-go, every profile on,
// its variables interpolated from environ alone (nil: every variable unset,
// as `docker compose up` runs it on a machine that sets none), and returns
// its services in name order, by name, and its top-level volumes. A file
// that Compose v2 would reject fails here.
func loadCompose(t *testing.T, environ map[string]string) (services []*composeService, byName map[string]*composeService, volumes []string) {
	t.Helper()
	path, err := filepath.Abs(filepath.Join(repoRoot, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	project, err := loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  filepath.Dir(path),
		ConfigFiles: []types.ConfigFile{{Filename: path}},
		Environment: types.Mapping(maps.Clone(environ)),
	}, func(o *loader.Options) {
		o.SetProjectName("shop", true)
		o.Profiles = []string{"*"}
		o.ResolvePaths = false // keep ./deploy/… as the file writes it
	})
	if err != nil {
		t.Fatalf("docker-compose.yml does not load as Compose v2 loads it: %v", err)
	}
	for name := range project.Volumes {
		volumes = append(volumes, name)
	}
	slices.Sort(volumes)
	byName = map[string]*composeService{}
	for _, name := range slices.Sorted(maps.Keys(project.Services)) {
		sc := project.Services[name]
		s := &composeService{name: name, image: sc.Image, restart: sc.Restart, profs: sc.Profiles,
			command: sc.Command, entrypoint: sc.Entrypoint, env: map[string]string{}, dependsOn: map[string]composeDep{}}
		for _, p := range sc.Ports {
			s.ports = append(s.ports, p.Published+":"+strconv.Itoa(int(p.Target)))
		}
		for _, v := range sc.Volumes {
			spec := v.Source + ":" + v.Target
			if v.ReadOnly {
				spec += ":ro"
			}
			s.volumes = append(s.volumes, spec)
		}
		for k, v := range sc.Environment {
			if v == nil {
				t.Errorf("service %s: environment %s has no value", name, k)
				continue
			}
			s.env[k] = *v
			s.envKeys = append(s.envKeys, k)
		}
		slices.Sort(s.envKeys)
		if hc := sc.HealthCheck; hc != nil && !hc.Disable {
			s.healthcheck = hc.Test
			if len(s.healthcheck) == 0 {
				t.Errorf("service %s: healthcheck without a test", name)
			}
		}
		for d, dep := range sc.DependsOn {
			s.dependsOn[d] = composeDep{condition: dep.Condition, required: dep.Required}
		}
		services = append(services, s)
		byName[name] = s
	}
	return services, byName, volumes
}

// shopImage is the image built from this repository's Dockerfile.
const shopImage = "shop:dev"

// isShop reports whether the service runs the image built from this
// repository: a shop process.
func (s *composeService) isShop() bool { return s.image == shopImage }

// portOf returns the port of a listen address such as ":8081".
func portOf(t *testing.T, addr string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	return port
}

func TestComposeEnvVars(t *testing.T) {
	vars := config.EnvVars(services.Deployed())
	// The contract's configuration table.
	want := []string{"DATABASE_URL", "NATS_URL", "PAYMENT_TIMEOUT", "PAYMENT_WEBHOOK_SECRET", "FULFILLMENT_DELAY"}
	for _, name := range services.Deployed().Names() {
		p := strings.ToUpper(name)
		want = append(want, p+"_ADDR", p+"_DATABASE_URL")
	}
	for _, v := range want {
		if !slices.Contains(vars, v) {
			t.Errorf("config.EnvVars(services.Deployed()) = %v lacks %s", vars, v)
		}
	}
	// Nothing but those: every variable config.EnvVars names changes the
	// configuration LoadConfig returns (as its log shows it: every setting,
	// a secret as whether it is set).
	base, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vars {
		value := "42h" // a duration, and a string
		if v == "NATS_REPLICAS" || v == "NATS_STREAM_MAX_BYTES" {
			value = "3" // a count
		}
		if v == "DASHBOARD_DEMO" {
			value = "true" // a switch, off by default
		}
		if strings.HasSuffix(v, "RELAY_MODE") { // the mode the default is not
			value = string(outbox.ModePoll)
			if config.DefaultRelayMode == outbox.ModePoll {
				value = string(outbox.ModeCDC)
			}
		}
		// A service's own setting: a value of its kind.
		if def, ok := base.Settings.Value(v); ok {
			switch def.(type) {
			case int64:
				value = "3"
			case bool:
				value = strconv.FormatBool(!def.(bool))
			}
		}
		cfg, err := LoadConfig(func(k string) string {
			if k == v {
				return value
			}
			return ""
		})
		if err != nil {
			t.Errorf("%s=%s: %v", v, value, err)
		} else if cfg.LogValue().String() == base.LogValue().String() {
			t.Errorf("config.EnvVars names %s, but LoadConfig ignores it", v)
		}
	}
}

func TestComposeServices(t *testing.T) {
	composed, byName, volumes := loadCompose(t, nil)

	for _, want := range []string{"postgres", "nats", "migrate", "seed", "nats-1", "nats-2", "nats-3", "jaeger", "dashboard"} {
		if byName[want] == nil {
			t.Errorf("docker-compose.yml has no service %s", want)
		}
	}
	// Every service of the registry has its container.
	for _, e := range services.Deployed() {
		if byName[e.Name] == nil {
			t.Errorf("docker-compose.yml has no service %s, which services.Deployed() has: copy another service's block under "+
				"services: as %s, with command: [%q], %s_ADDR: %q, ports [\"%s:%s\"], its /readyz healthcheck and %s; "+
				"add %s to every NATS server's environment and %s_URL to the dashboard's (docs/adding-a-service.md, 6)",
				e.Name, e.Name, e.Name, strings.ToUpper(e.Name), e.Addr, portOf(t, e.Addr), portOf(t, e.Addr),
				broker.PasswordVar(e.Name), broker.PasswordVar(e.Name), strings.ToUpper(e.Name))
		}
	}
	if t.Failed() {
		t.FailNow()
	}

	envVars := config.EnvVars(services.Deployed())
	pg, nats := byName["postgres"], byName["nats"]
	for _, s := range composed {
		// Long-running services report their health; one-shots do not run long.
		if !slices.Contains(oneShot, s.name) && len(s.healthcheck) == 0 {
			t.Errorf("service %s runs for good but has no healthcheck", s.name)
		}
		if slices.Contains(oneShot, s.name) && s.restart != "" && s.restart != "no" {
			t.Errorf("one-shot service %s restarts (%s)", s.name, s.restart)
		}
		for d, dep := range s.dependsOn {
			target := byName[d]
			switch {
			case target == nil:
				t.Errorf("service %s depends on unknown service %s", s.name, d)
			case dep.condition == "service_healthy" && len(target.healthcheck) == 0:
				t.Errorf("service %s waits for %s to be healthy, which has no healthcheck", s.name, d)
			case dep.condition == "service_completed_successfully" && !slices.Contains(oneShot, d):
				t.Errorf("service %s waits for long-running %s to complete", s.name, d)
			case len(target.profs) > 0 && dep.required && len(s.profs) == 0:
				t.Errorf("service %s requires %s, which only runs in profile %v: mark it `required: false`", s.name, d, target.profs)
			}
		}
		for _, v := range s.volumes {
			src, _, _ := strings.Cut(v, ":")
			if strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") {
				if _, err := os.Stat(filepath.Join(repoRoot, src)); err != nil {
					t.Errorf("service %s mounts %s: %v", s.name, src, err)
				}
			} else if !slices.Contains(volumes, src) {
				t.Errorf("service %s uses volume %s, not declared under volumes", s.name, src)
			}
		}

		if !s.isShop() {
			continue
		}
		// A shop process: a real subcommand, only variables the code reads.
		if s.image != byName["migrate"].image {
			t.Errorf("service %s: image %q, want the one image %q", s.name, s.image, byName["migrate"].image)
		}
		if len(s.entrypoint) > 0 {
			t.Errorf("service %s overrides the image's ENTRYPOINT [\"/shop\"]", s.name)
		}
		if len(s.command) == 0 || !slices.Contains(shopCommands, s.command[0]) {
			t.Errorf("service %s: command %q is not a shop subcommand (%v)", s.name, s.command, shopCommands)
			continue
		}
		for _, k := range s.envKeys {
			if !slices.Contains(envVars, k) {
				t.Errorf("service %s sets %s, which the shop does not read (it reads %v)", s.name, k, envVars)
			}
		}
		env := map[string]string{}
		for k, v := range s.env {
			env[k] = v
		}
		cfg, err := LoadConfig(func(k string) string { return env[k] })
		if err != nil {
			t.Errorf("service %s: its environment does not load: %v", s.name, err)
			continue
		}
		if dep := s.dependsOn["postgres"]; dep.condition != "service_healthy" || !dep.required {
			t.Errorf("service %s: depends_on postgres %+v, want condition service_healthy", s.name, dep)
		}
		db, err := url.Parse(cfg.DatabaseURL)
		if err != nil || db.Hostname() != "postgres" || db.Port() != "5432" {
			t.Errorf("service %s: DATABASE_URL %q, want the postgres service at postgres:5432", s.name, cfg.DatabaseURL)
		} else if pw, _ := db.User.Password(); pw != pg.env["POSTGRES_PASSWORD"] {
			t.Errorf("service %s: DATABASE_URL password differs from the postgres service's POSTGRES_PASSWORD", s.name)
		}

		name := s.command[0]
		if name == "migrate" {
			if len(s.ports) > 0 || len(s.healthcheck) > 0 {
				t.Errorf("service migrate is a one-shot: no ports, no healthcheck")
			}
			continue
		}
		if name == "dashboard" {
			checkComposeDashboard(t, s, cfg, byName)
			continue
		}
		if !slices.Contains(services.Deployed().Names(), name) {
			t.Errorf("service %s runs `shop %s`; compose runs the services one by one", s.name, name)
			continue
		}
		// A service: the broker, its listen address, its port, its health.
		for _, d := range []string{"nats", "migrate"} {
			want := map[string]string{"nats": "service_healthy", "migrate": "service_completed_successfully"}[d]
			if dep := s.dependsOn[d]; dep.condition != want || !dep.required {
				t.Errorf("service %s: depends_on %s %+v, want condition %s", s.name, d, dep, want)
			}
		}
		for _, d := range []string{"nats-1", "nats-2", "nats-3"} {
			if dep, ok := s.dependsOn[d]; !ok || dep.condition != "service_healthy" || dep.required {
				t.Errorf("service %s: depends_on %s %+v, want service_healthy and required: false (profile cluster)", s.name, d, dep)
			}
		}
		if nu, err := url.Parse(cfg.NATSURL); err != nil || nu.Hostname() != "nats" || nu.Port() != "4222" {
			t.Errorf("service %s: NATS_URL defaults to %q, want nats://nats:4222", s.name, cfg.NATSURL)
		}
		addrVar := strings.ToUpper(name) + "_ADDR"
		if _, ok := s.env[addrVar]; !ok {
			t.Errorf("service %s does not set %s", s.name, addrVar)
		}
		if got, want := cfg.Services[name].Addr, defaultAddr(t, name); got != want {
			t.Errorf("service %s: %s=%s, the contract's default is %s", s.name, addrVar, got, want)
		}
		port := portOf(t, cfg.Services[name].Addr)
		if want := []string{port + ":" + port}; !slices.Equal(s.ports, want) {
			t.Errorf("service %s: ports %q, want %q (%s)", s.name, s.ports, want, addrVar)
		}
		if want := "http://127.0.0.1:" + port + "/readyz"; len(s.healthcheck) == 0 || s.healthcheck[len(s.healthcheck)-1] != want || s.healthcheck[0] != "CMD" || s.healthcheck[1] != "curl" {
			t.Errorf("service %s: healthcheck %q, want [CMD curl … %s]", s.name, s.healthcheck, want)
		}
		if s.restart == "" || s.restart == "no" {
			t.Errorf("service %s does not restart after a crash", s.name)
		}
		// Traces go to the jaeger service's OTLP/HTTP port.
		if u, err := url.Parse(cfg.TracesEndpoint); err != nil || u.Hostname() != "jaeger" || u.Port() != "4318" {
			t.Errorf("service %s: OTEL_EXPORTER_OTLP_ENDPOINT %q, want the jaeger service's OTLP/HTTP port (http://jaeger:4318)", s.name, cfg.TracesEndpoint)
		}
	}

	// Where the traces go: Jaeger with OTLP on and its UI published.
	if j := byName["jaeger"]; j == nil {
		t.Error("docker-compose.yml has no service jaeger")
	} else {
		checkComposeJaeger(t, j)
		if !slices.Contains(j.ports, "16686:16686") || !slices.Contains(j.ports, "4318:4318") {
			t.Errorf("jaeger: ports %q, want the UI 16686 and OTLP/HTTP 4318", j.ports)
		}
		if len(j.profs) > 0 {
			t.Errorf("jaeger runs only in profiles %v", j.profs)
		}
	}

	// The dependencies the services lean on.
	if !slices.Contains(pg.healthcheck, "pg_isready") {
		t.Errorf("postgres healthcheck %q does not use pg_isready", pg.healthcheck)
	}
	if !strings.HasPrefix(pg.image, "postgres:") || pg.env["POSTGRES_PASSWORD"] == "" {
		t.Errorf("postgres: image %q, POSTGRES_PASSWORD %q", pg.image, pg.env["POSTGRES_PASSWORD"])
	}
	checkComposePostgresSettings(t, pg)
	// One nats-server version line: compose runs the release that go.mod
	// requires, which the tests and the chaos run use.
	gomod, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	natsVersion := regexp.MustCompile(`(?m)^\s*github\.com/nats-io/nats-server/v2 v(\S+)$`).FindSubmatch(gomod)
	if natsVersion == nil {
		t.Fatal("go.mod does not require github.com/nats-io/nats-server/v2")
	}
	for _, n := range []*composeService{nats, byName["nats-1"], byName["nats-2"], byName["nats-3"]} {
		// The alpine image: the health check needs its wget.
		if want := "nats:" + string(natsVersion[1]) + "-alpine"; n.image != want {
			t.Errorf("service %s: image %q, want %s (go.mod's nats-server, the alpine image for wget)", n.name, n.image, want)
		}
		if len(n.healthcheck) < 2 || n.healthcheck[1] != "wget" || !strings.HasSuffix(n.healthcheck[len(n.healthcheck)-1], ":8222/healthz") {
			t.Errorf("service %s: healthcheck %q, want wget of the monitoring port's /healthz", n.name, n.healthcheck)
		}
	}
	if !slices.Equal(nats.command, []string{"nats-server", "-c", "/etc/nats/single.conf"}) {
		t.Errorf("nats command %q, want nats-server run by deploy/nats/single.conf (TestComposeNATSSync reads it)", nats.command)
	}
	if !slices.Contains(nats.volumes, "./deploy/nats/single.conf:/etc/nats/single.conf:ro") || !slices.Contains(nats.volumes, "nats:/data") {
		t.Errorf("nats volumes %q, want deploy/nats/single.conf and nats:/data", nats.volumes)
	}
	if len(nats.profs) > 0 || len(pg.profs) > 0 {
		t.Error("postgres and nats must run without a profile")
	}
	for _, n := range services.Deployed().Names() {
		if len(byName[n].profs) > 0 {
			t.Errorf("service %s runs only in profiles %v", n, byName[n].profs)
		}
	}
}

// jaegerReleases maps the module version of tools/jaeger (what `make
// trace-check` proves a trace against) to the Jaeger release, the tag of
// its image: Jaeger v2's module keeps the v1 line.
var jaegerReleases = map[string]string{"v1.75.0": "2.12.0"}

// checkComposeJaeger holds the jaeger service to the release tools/jaeger
// builds, with its health check on Jaeger v2's port.
func checkComposeJaeger(t *testing.T, j *composeService) {
	t.Helper()
	gomod, err := os.ReadFile(filepath.Join(repoRoot, "tools/jaeger/go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*github\.com/jaegertracing/jaeger (v\S+)`).FindSubmatch(gomod)
	if m == nil {
		t.Fatal("tools/jaeger/go.mod does not require github.com/jaegertracing/jaeger")
	}
	release, ok := jaegerReleases[string(m[1])]
	if !ok {
		t.Fatalf("tools/jaeger builds jaeger %s: add its release (CHANGELOG.md: vX / v2.Y) to jaegerReleases", m[1])
	}
	if want := "jaegertracing/jaeger:" + release; j.image != want {
		t.Errorf("jaeger: image %q, want %s, the release tools/jaeger builds (%s)", j.image, want, m[1])
	}
	if len(j.healthcheck) < 2 || !strings.HasSuffix(j.healthcheck[len(j.healthcheck)-1], ":13133/status") {
		t.Errorf("jaeger: healthcheck %q, want Jaeger v2's :13133/status", j.healthcheck)
	}
}

// cdcSettings are the server settings a relay in cdc mode needs
// (pkg/outbox's ModeCDC): compose's Postgres runs with them, and
// scripts/ensure-postgres.sh makes them on a local cluster.
var cdcSettings = map[string]string{
	"wal_level":              "logical",
	"max_replication_slots":  "64",
	"max_wal_senders":        "64",
	"max_slot_wal_keep_size": "2GB", // a forgotten slot cannot fill the volume
}

// checkComposePostgresSettings checks that the postgres service runs with
// cdcSettings (`postgres -c name=value ...`): without them RELAY_MODE=cdc
// would fall back to polling in the demo, and an unread slot could keep
// WAL without bound. The script that makes a local cluster names the same.
func checkComposePostgresSettings(t *testing.T, pg *composeService) {
	t.Helper()
	got := map[string]string{}
	if len(pg.command) == 0 || pg.command[0] != "postgres" {
		t.Errorf("postgres: command %q, want [postgres -c name=value ...]", pg.command)
	}
	for i := 1; i < len(pg.command); i++ {
		if pg.command[i] != "-c" || i+1 == len(pg.command) {
			t.Errorf("postgres: command %q: %q is not -c name=value", pg.command, pg.command[i])
			continue
		}
		i++
		k, v, _ := strings.Cut(pg.command[i], "=")
		got[k] = v
	}
	script, err := os.ReadFile(filepath.Join(repoRoot, "scripts", "ensure-postgres.sh"))
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range cdcSettings {
		if got[k] != want {
			t.Errorf("postgres: command sets %s=%q, want %q (the CDC relay's settings)", k, got[k], want)
		}
		if !strings.Contains(string(script), k+"="+want) {
			t.Errorf("scripts/ensure-postgres.sh does not set %s=%s for a local cluster", k, want)
		}
	}
}

// TestComposeRelayMode: every service passes RELAY_MODE and its own
// <NAME>_RELAY_MODE through from the host's environment (README, "Relay
// mode"), empty (the shop's default) when the host sets neither.
func TestComposeRelayMode(t *testing.T) {
	_, byName, _ := loadCompose(t, nil)
	for _, name := range services.Deployed().Names() {
		if byName[name] == nil {
			// A failure naming the service, never a nil dereference that
			// takes the package's other tests down with it.
			t.Errorf("docker-compose.yml has no service %s (TestComposeServices says what to add)", name)
			continue
		}
		own := strings.ToUpper(name) + "_RELAY_MODE"
		for _, k := range []string{"RELAY_MODE", own} {
			if v, ok := byName[name].env[k]; !ok || v != "" {
				t.Errorf("service %s: %s=%q (set: %v), want it passed through, empty by default", name, k, v, ok)
			}
		}
	}
	_, byName, _ = loadCompose(t, map[string]string{"RELAY_MODE": "cdc", "PAYMENT_RELAY_MODE": "poll"})
	for _, name := range services.Deployed().Names() {
		if byName[name] == nil {
			continue // reported above
		}
		if got := byName[name].env["RELAY_MODE"]; got != "cdc" {
			t.Errorf("service %s: RELAY_MODE=%q with the host's cdc", name, got)
		}
	}
	if got := byName["payment"].env["PAYMENT_RELAY_MODE"]; got != "poll" {
		t.Errorf("service payment: PAYMENT_RELAY_MODE=%q with the host's poll", got)
	}
}

// checkComposeDashboard checks the dashboard service: `shop dashboard` on
// its own port, calling the order and payment services by their compose
// names, offering "Pay" exactly when the payment service's fake provider
// is on, and started once they are healthy.
func checkComposeDashboard(t *testing.T, s *composeService, cfg config.Config, byName map[string]*composeService) {
	t.Helper()
	port := portOf(t, cfg.DashboardAddr)
	if want := "${SHOP_DASHBOARD_PORT:-8080}"; !slices.Contains(s.ports, "8080:"+port) {
		t.Errorf("service dashboard: ports %q, want %s on the host to %s", s.ports, want, port)
	}
	if want := "http://127.0.0.1:" + port + "/api/state"; len(s.healthcheck) < 2 || s.healthcheck[1] != "curl" || s.healthcheck[len(s.healthcheck)-1] != want {
		t.Errorf("service dashboard: healthcheck %q, want [CMD curl … %s]", s.healthcheck, want)
	}
	// Every service's URL, for the health strip; the order and payment
	// services' before the page starts, for it places and pays orders.
	for _, name := range services.Deployed().Names() {
		got := cfg.Services[name].URL
		u, err := url.Parse(got)
		if err != nil || u.Hostname() != name || u.Port() != portOf(t, defaultAddr(t, name)) {
			t.Errorf("service dashboard: %s_URL %q, want the %s service at %s:%s", strings.ToUpper(name), got, name, name, portOf(t, defaultAddr(t, name)))
		}
	}
	for _, name := range []string{"order", "payment"} {
		if dep := s.dependsOn[name]; dep.condition != "service_healthy" || !dep.required {
			t.Errorf("service dashboard: depends_on %s %+v, want service_healthy", name, dep)
		}
	}
	if dep := s.dependsOn["migrate"]; dep.condition != "service_completed_successfully" {
		t.Errorf("service dashboard: depends_on migrate %+v, want service_completed_successfully", dep)
	}
	if got, want := s.env["PAYMENT_FAKE_PROVIDER"], byName["payment"].env["PAYMENT_FAKE_PROVIDER"]; got != want {
		t.Errorf("service dashboard: PAYMENT_FAKE_PROVIDER %q, the payment service's %q: the Pay button would lie", got, want)
	}
	if got, want := s.env["PAYMENT_TIMEOUT"], byName["order"].env["PAYMENT_TIMEOUT"]; got != want {
		t.Errorf("service dashboard: PAYMENT_TIMEOUT %q, the order service's %q", got, want)
	}
	if s.restart == "" || s.restart == "no" {
		t.Error("service dashboard does not restart after a crash")
	}
}

// TestComposePorts holds the ports docker-compose.yml publishes on the host:
// Postgres and NATS (and its monitoring port), the dashboard and Jaeger behind
// variables, with defaults that leave a Postgres (5432) or NATS (4222,
// 8222) of the machine alone; no host port published twice; a variable
// that is set moves its port.
func TestComposePorts(t *testing.T) {
	vars := map[string]struct {
		service, def, target string
	}{
		"SHOP_POSTGRES_PORT":     {"postgres", "15432", "5432"},
		"SHOP_NATS_PORT":         {"nats", "14222", "4222"},
		"SHOP_NATS_MONITOR_PORT": {"nats", "18222", "8222"},
		"SHOP_DASHBOARD_PORT":    {"dashboard", "8080", "8080"},
		"SHOP_JAEGER_UI_PORT":    {"jaeger", "16686", "16686"},
		"SHOP_JAEGER_OTLP_PORT":  {"jaeger", "4318", "4318"},
	}
	composed, byName, _ := loadCompose(t, nil)
	published := map[string]string{}
	for _, s := range composed {
		for _, p := range s.ports {
			host, _, _ := strings.Cut(p, ":")
			if other, dup := published[host]; dup {
				t.Errorf("host port %s is published by %s and %s", host, other, s.name)
			}
			published[host] = s.name
		}
	}
	for _, taken := range []string{"5432", "4222", "8222"} {
		if s, ok := published[taken]; ok {
			t.Errorf("service %s publishes %s, which a Postgres or NATS of the machine holds", s, taken)
		}
	}
	for v, p := range vars {
		if want := p.def + ":" + p.target; !slices.Contains(byName[p.service].ports, want) {
			t.Errorf("service %s: ports %q lack %s (%s unset)", p.service, byName[p.service].ports, want, v)
		}
	}
	set := map[string]string{}
	for v := range vars {
		set[v] = strconv.Itoa(40000 + len(set))
	}
	_, byName, _ = loadCompose(t, set)
	for v, p := range vars {
		if want := set[v] + ":" + p.target; !slices.Contains(byName[p.service].ports, want) {
			t.Errorf("service %s: ports %q lack %s (%s=%s)", p.service, byName[p.service].ports, want, v, set[v])
		}
	}

	// The README names the ports and the Compose version the file needs.
	readme, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Compose 2.20", "unsupported option: 'required'"} {
		if !strings.Contains(string(readme), want) {
			t.Errorf("README.md does not say %q", want)
		}
	}
	for v := range vars {
		if !strings.Contains(string(readme), v) {
			t.Errorf("README.md does not name %s", v)
		}
	}
}

func TestComposeSeed(t *testing.T) {
	_, byName, _ := loadCompose(t, nil)
	seed := byName["seed"]
	if seed == nil {
		t.Fatal("no seed service")
	}
	if dep := seed.dependsOn["inventory"]; dep.condition != "service_healthy" {
		t.Errorf("seed: depends_on inventory %+v, want service_healthy", dep)
	}
	u, err := url.Parse(seed.env["INVENTORY_URL"])
	if err != nil || u.Hostname() != "inventory" || u.Port() != portOf(t, defaultAddr(t, "inventory")) {
		t.Errorf("seed: INVENTORY_URL %q, want the inventory service on %s", seed.env["INVENTORY_URL"], defaultAddr(t, "inventory"))
	}
	if !slices.Contains(seed.volumes, "./deploy/seed.sh:/seed.sh:ro") || !slices.Equal(seed.entrypoint, []string{"/bin/sh", "/seed.sh"}) {
		t.Errorf("seed: volumes %q, entrypoint %q: want deploy/seed.sh run as /seed.sh", seed.volumes, seed.entrypoint)
	}
	// The seed restocks with the operator token the inventory service is
	// given, whatever the operator sets.
	if inv, ok := byName["inventory"].env["OPERATOR_TOKEN"]; !ok || seed.env["OPERATOR_TOKEN"] != inv {
		t.Errorf("seed: OPERATOR_TOKEN %q, the inventory service's %q (set: %v): want the same", seed.env["OPERATOR_TOKEN"], inv, ok)
	}

	// deploy/seed.sh stocks the catalogue `shop all -demo` stocks.
	data, err := os.ReadFile(filepath.Join(repoRoot, "deploy/seed.sh"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), `-H "Authorization: Bearer $OPERATOR_TOKEN"`) {
		t.Error("deploy/seed.sh does not send OPERATOR_TOKEN as a bearer token")
	}
	var got []string
	for _, m := range regexp.MustCompile(`(?m)^seed (\S+) (\d+) (\d+)$`).FindAllStringSubmatch(string(data), -1) {
		got = append(got, m[1]+" "+m[2]+" "+m[3])
	}
	var want []string
	for _, p := range demo.Catalogue {
		want = append(want, fmt.Sprintf("%s %d %d", p.SKU, p.OnHand, p.Price))
	}
	if !slices.Equal(got, want) {
		t.Errorf("deploy/seed.sh stocks %q, the demo catalogue (internal/demo) is %q", got, want)
	}
}

func TestComposeNATSCluster(t *testing.T) {
	_, byName, _ := loadCompose(t, nil)
	setNATSPasswords(t, byName["nats-1"])
	nodes := []string{"nats-1", "nats-2", "nats-3"}
	var routes []string
	for _, n := range nodes {
		routes = append(routes, "nats-route://"+n+":6222")
	}
	for _, name := range nodes {
		s := byName[name]
		if s == nil {
			t.Fatalf("no service %s", name)
		}
		if !slices.Equal(s.profs, []string{"cluster"}) {
			t.Errorf("service %s: profiles %q, want [cluster]", name, s.profs)
		}
		if s.env["NATS_SERVER_NAME"] != name {
			t.Errorf("service %s: NATS_SERVER_NAME=%q, want its own name", name, s.env["NATS_SERVER_NAME"])
		}
		if !slices.Contains(s.volumes, "./deploy/nats/cluster.conf:/etc/nats/cluster.conf:ro") || !slices.Contains(s.volumes, name+":/data") {
			t.Errorf("service %s: volumes %q, want the cluster config and its own data volume", name, s.volumes)
		}
		if !slices.Equal(s.command, []string{"nats-server", "-c", "/etc/nats/cluster.conf"}) {
			t.Errorf("service %s: command %q", name, s.command)
		}

		// The config as nats-server itself reads it, in this container.
		t.Setenv("NATS_SERVER_NAME", name)
		opts, err := server.ProcessConfigFile(filepath.Join(repoRoot, "deploy/nats/cluster.conf"))
		if err != nil {
			t.Fatalf("deploy/nats/cluster.conf: %v", err)
		}
		var gotRoutes []string
		for _, r := range opts.Routes {
			gotRoutes = append(gotRoutes, r.String())
		}
		switch {
		case opts.ServerName != name:
			t.Errorf("%s: server_name %q", name, opts.ServerName)
		case !opts.JetStream || opts.StoreDir != "/data":
			t.Errorf("%s: jetstream %v in %q, want JetStream in /data (the volume)", name, opts.JetStream, opts.StoreDir)
		case opts.Port != 4222 || opts.HTTPPort != 8222:
			t.Errorf("%s: client port %d, monitoring port %d; want 4222 and 8222", name, opts.Port, opts.HTTPPort)
		case opts.Cluster.Name == "" || opts.Cluster.Port != 6222:
			t.Errorf("%s: cluster %q on port %d, want a named cluster on 6222", name, opts.Cluster.Name, opts.Cluster.Port)
		case !slices.Equal(gotRoutes, routes):
			t.Errorf("%s: routes %q, want %q", name, gotRoutes, routes)
		}
	}
}

// TestComposeNATSSync holds the NATS servers of docker-compose.yml to the
// shop's fsync policy: the single server (deploy/nats/single.conf, service
// nats) syncs exactly as the embedded server of `shop all` does
// (broker.Embedded's default: before every acknowledgement), and every node
// of the cluster profile (deploy/nats/cluster.conf) syncs before it
// acknowledges too. A file that drops or changes `sync_interval` fails here.
func TestComposeNATSSync(t *testing.T) {
	_, byName, _ := loadCompose(t, nil)
	setNATSPasswords(t, byName["nats"])
	srv, err := broker.Embedded("127.0.0.1", -1, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	shop := srv.JetStreamConfig()
	srv.Shutdown()
	if !shop.SyncAlways {
		t.Fatalf("the embedded server of shop all syncs every %v, not before each ack: the policy the deployment files are held to changed", shop.SyncInterval)
	}

	single, err := server.ProcessConfigFile(filepath.Join(repoRoot, "deploy/nats/single.conf"))
	if err != nil {
		t.Fatalf("deploy/nats/single.conf: %v", err)
	}
	switch {
	case single.SyncAlways != shop.SyncAlways || single.SyncInterval != shop.SyncInterval:
		t.Errorf("deploy/nats/single.conf: sync always %v, every %v; the embedded server of shop all: always %v, every %v",
			single.SyncAlways, single.SyncInterval, shop.SyncAlways, shop.SyncInterval)
	case !single.JetStream || single.StoreDir != "/data":
		t.Errorf("deploy/nats/single.conf: jetstream %v in %q, want JetStream in /data (the volume)", single.JetStream, single.StoreDir)
	case single.Port != 4222 || single.HTTPPort != 8222:
		t.Errorf("deploy/nats/single.conf: client port %d, monitoring port %d; want 4222 and 8222", single.Port, single.HTTPPort)
	}

	t.Setenv("NATS_SERVER_NAME", "nats-1")
	cluster, err := server.ProcessConfigFile(filepath.Join(repoRoot, "deploy/nats/cluster.conf"))
	if err != nil {
		t.Fatalf("deploy/nats/cluster.conf: %v", err)
	}
	if !cluster.SyncAlways {
		t.Errorf("deploy/nats/cluster.conf: fsync every %v, want sync_interval: always (the policy its comment states)", cluster.SyncInterval)
	}
}

func TestComposeDockerfile(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	df := string(data)
	gomod, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(string(gomod))
	if goVersion == nil {
		t.Fatal("go.mod has no go directive")
	}
	if want := "FROM golang:" + goVersion[1] + " AS build"; !strings.Contains(df, want) {
		t.Errorf("Dockerfile lacks %q (go.mod says go %s)", want, goVersion[1])
	}
	for _, want := range []string{
		`CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/shop ./cmd/shop`, // as shopBinary builds it
		"COPY --from=build /out/shop /shop",
		`ENTRYPOINT ["/shop"]`,
	} {
		if !strings.Contains(df, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	users := regexp.MustCompile(`(?m)^USER (\S+)`).FindAllStringSubmatch(df, -1)
	if len(users) == 0 {
		t.Error("Dockerfile sets no USER: the shop would run as root")
	} else if u := users[len(users)-1][1]; u == "root" || u == "0" || strings.HasPrefix(u, "0:") {
		t.Errorf("Dockerfile runs as %s", u)
	}
	// EXPOSE covers the dashboard's port and every service's: a range with
	// room for more, so that a new service needs no edit here as long as
	// its port falls in it.
	var ranges [][2]int
	for _, m := range regexp.MustCompile(`(?m)^EXPOSE (\d+)(?:-(\d+))?$`).FindAllStringSubmatch(df, -1) {
		lo, _ := strconv.Atoi(m[1])
		hi := lo
		if m[2] != "" {
			hi, _ = strconv.Atoi(m[2])
		}
		ranges = append(ranges, [2]int{lo, hi})
	}
	exposed := func(port int) bool {
		return slices.ContainsFunc(ranges, func(r [2]int) bool { return r[0] <= port && port <= r[1] })
	}
	ports := map[string]string{"the dashboard": config.DefaultDashboardAddr}
	for _, e := range services.Deployed() {
		ports["service "+e.Name] = e.Addr
	}
	for who, addr := range ports {
		if p, _ := strconv.Atoi(portOf(t, addr)); !exposed(p) {
			t.Errorf("Dockerfile does not EXPOSE %d, %s's default port (it exposes %v): pick an Addr in the range, or widen EXPOSE",
				p, who, ranges)
		}
	}
}

// TestComposeNATSUsers holds docker-compose.yml to the shop's NATS users:
// every NATS server mounts deploy/nats/auth.conf and gets every user's
// password; every service gets its own user's password, with the same
// default as the servers', and no other's but the stream keeper's, which
// the order service (where the reconciler runs) gets and no other; and the
// servers' configuration, as nats-server reads it with those passwords, has
// exactly the users and permissions of broker.Users (what the embedded
// server of `shop all` runs).
func TestComposeNATSUsers(t *testing.T) {
	_, byName, _ := loadCompose(t, nil)
	users := []string{broker.AuditUser, broker.StreamsUser}
	for _, a := range services.Deployed().Access() {
		users = append(users, a.User)
	}
	defaults := map[string]string{}
	for _, name := range []string{"nats", "nats-1", "nats-2", "nats-3"} {
		s := byName[name]
		if !slices.Contains(s.volumes, "./deploy/nats/auth.conf:/etc/nats/auth.conf:ro") {
			t.Errorf("service %s does not mount deploy/nats/auth.conf beside its config: volumes %q", name, s.volumes)
		}
		for _, u := range users {
			v, ok := s.env[broker.PasswordVar(u)]
			if !ok || v == "" {
				t.Errorf("service %s: %s is not set (nats-server refuses to start without it)", name, broker.PasswordVar(u))
			}
			if d, seen := defaults[u]; seen && d != v {
				t.Errorf("service %s: %s defaults to %q, another NATS server's to %q", name, broker.PasswordVar(u), v, d)
			}
			defaults[u] = v
		}
	}
	for _, name := range services.Deployed().Names() {
		s := byName[name]
		if s == nil {
			t.Errorf("docker-compose.yml has no service %s (TestComposeServices says what to add)", name)
			continue
		}
		for _, u := range users {
			v, ok := s.env[broker.PasswordVar(u)]
			// Its own user's, and the order service the keeper's too.
			mine := u == name || (u == broker.StreamsUser && name == "order")
			switch {
			case mine && !ok:
				t.Errorf("service %s has no %s NATS user: set %s", name, u, broker.PasswordVar(u))
			case mine && v != defaults[u]:
				t.Errorf("service %s: %s defaults to %q, the NATS servers' to %q", name, broker.PasswordVar(u), v, defaults[u])
			case !mine && ok:
				t.Errorf("service %s is given %s, another user's password", name, broker.PasswordVar(u))
			}
		}
	}

	want, err := broker.Users(services.Deployed().Access(), defaults)
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range users {
		t.Setenv(broker.PasswordVar(u), defaults[u])
	}
	t.Setenv("NATS_SERVER_NAME", "nats-1")
	for _, file := range []string{"single.conf", "cluster.conf"} {
		opts, err := server.ProcessConfigFile(filepath.Join(repoRoot, "deploy/nats", file))
		if err != nil {
			t.Fatalf("deploy/nats/%s: %v", file, err)
		}
		if opts.NoAuthUser != "" || len(opts.Users) != len(want) {
			t.Fatalf("deploy/nats/%s: %d users (no_auth_user %q), want the %d of broker.Users "+
				"(regenerate deploy/nats/auth.conf: go test ./internal/broker -run TestAuthConfMatchesTheTable -update)",
				file, len(opts.Users), opts.NoAuthUser, len(want))
		}
		for i, u := range opts.Users {
			w := want[i]
			if u.Username != w.Username || u.Password != w.Password || !reflect.DeepEqual(u.Permissions, w.Permissions) {
				t.Errorf("deploy/nats/%s: user %s differs from broker.Users' %s (regenerate auth.conf: go test ./internal/broker -run TestAuthConfMatchesTheTable -update)",
					file, u.Username, w.Username)
			}
		}
	}
}

// setNATSPasswords sets the users' passwords as the NATS server s has them
// by default, for nats-server to read its configuration (auth.conf refers
// to them).
func setNATSPasswords(t *testing.T, s *composeService) {
	t.Helper()
	for k, v := range s.env {
		if strings.HasSuffix(k, "_NATS_PASSWORD") {
			t.Setenv(k, v)
		}
	}
}

// defaultAddr is the default HTTP address of the service called name.
func defaultAddr(t *testing.T, name string) string {
	t.Helper()
	e, err := services.Deployed().Get(name)
	if err != nil {
		t.Fatal(err)
	}
	return e.Addr
}

// LoadConfig is config.LoadFor of the shop's own services, for the tests of
// this package. Only cmd/shop wires services.All into the code that runs
// (services/imports_test.go holds that rule); tests may use it.
func LoadConfig(getenv func(string) string) (config.Config, error) {
	return config.LoadFor(services.All, getenv)
}
