package app

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

// A service's NATS user may do what its registry entry declares; that must
// be what the service does: its user is its name, its stream the
// contract's, and its durables the consumers its domain really creates
// (which start-up checks too, checkConsumers).
func TestNATSAccessIsWhatEachServiceDoes(t *testing.T) {
	t.Parallel()
	_, js := natstest.New(t).Connect(t)
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // never connects: nothing runs
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cfg, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range services.All {
		a, schema := e.Access(), e.Schema
		if a.User != e.Name || a.Stream != strings.ToUpper(schema) || !slices.Equal(a.Subjects, []string{schema + ".>"}) {
			t.Errorf("%s: user %s, stream %s %v, the contract says %s %s [%s.>]", e.Name, a.User, a.Stream, a.Subjects, e.Name, strings.ToUpper(schema), schema)
		}
		dom := buildDomain(t, cfg, e.Name, registry.Deps{Pool: pool, JetStream: js})
		if err := checkConsumers(e, dom); err != nil {
			t.Error(err)
		}
		var have []broker.Durable
		for _, c := range dom.Consumers() {
			have = append(have, broker.Durable{Stream: c.Stream(), Name: c.Name()})
		}
		if !slices.Equal(have, a.Durables) {
			t.Errorf("%s creates the consumers %v, its NATS user may run %v", e.Name, have, a.Durables)
		}
	}
}

// A service connects as its own user to a server that requires the shop's
// users, and does its work there (the streams created by the keeper of its
// process) without a permissions violation; its password is never logged. Without a password it connects anonymously, as
// an unsecured server allows, and warns once.
func TestServiceConnectsAsItsOwnUser(t *testing.T) {
	t.Parallel()
	t.Run("with its password, on a secured server", func(t *testing.T) {
		t.Parallel()
		ns, passwords := natstest.NewSecured(t, services.All.Access())
		out, _ := runInventoryWith(t, map[string]string{"NATS_URL": ns.URL(), "INVENTORY_NATS_PASSWORD": passwords["inventory"],
			"STREAMS_NATS_PASSWORD": passwords[broker.StreamsUser]}, nil)
		_, js := ns.Connect(t)
		poll.Until(t, time.Minute, "inventory's stream and its durable consumer", func() bool {
			_, err := js.Consumer(context.Background(), "ORDERS", "inventory-orders")
			return err == nil
		})
		time.Sleep(3 * time.Second) // a few rounds of the JetStream probe and the admission of other services
		if s := out.String(); strings.Contains(s, "permissions violation") || strings.Contains(s, passwords["inventory"]) ||
			strings.Contains(s, "no NATS password") {
			t.Errorf("log:\n%s", s)
		}
	})
	t.Run("without one, on an open server", func(t *testing.T) {
		t.Parallel()
		ns := natstest.New(t)
		out := runInventory(t, ns.URL(), "")
		if n := strings.Count(out.String(), "no NATS password"); n != 1 {
			t.Errorf("warned %d times, want once; log:\n%s", n, out.String())
		}
	})
}

// A NATS server that refuses the service's credentials (its auth.conf has
// no such user: the service was added after it was generated) is no
// outage that passes: /readyz is not ready and says why, and the log says
// it is authentication and what to fix, once. Once the server is mended,
// the service connects by itself and is ready.
func TestRefusedCredentialsAreLoud(t *testing.T) {
	t.Parallel()
	const password = "inventory-secret"
	passwords := map[string]string{broker.AuditUser: "audit-secret", broker.StreamsUser: "streams-secret", "inventory": password}
	var others registry.Registry
	for _, e := range services.All {
		passwords[e.Name] = cmp.Or(passwords[e.Name], e.Name+"-secret")
		if e.Name != "inventory" {
			others = append(others, e)
		}
	}
	natsAddr, dir := freeAddr(t), t.TempDir()
	_, p, _ := net.SplitHostPort(natsAddr)
	port, _ := strconv.Atoi(p)
	// serve runs a NATS server with the users of reg on natsAddr until the
	// returned stop, the test's end at the latest.
	serve := func(reg registry.Registry) (stop func()) {
		t.Helper()
		users, err := broker.Users(reg.Access(), passwords)
		if err != nil {
			t.Fatal(err)
		}
		var srv *server.Server
		for range 50 { // the port may linger for a moment after a stop
			if srv, err = broker.Embedded("127.0.0.1", port, dir, broker.WithUsers(users)); err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
		stop = sync.OnceFunc(func() { srv.Shutdown(); srv.WaitForShutdown() })
		t.Cleanup(stop)
		return stop
	}
	stop := serve(others) // an auth.conf from before the inventory service

	db := pgtest.NewDatabase(t, "shop_app_auth_")
	addr := freeAddr(t)
	env := map[string]string{"NATS_URL": "nats://" + natsAddr, "INVENTORY_NATS_PASSWORD": password,
		"DATABASE_URL": db.URL, "INVENTORY_ADDR": addr}
	cfg, err := LoadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	out := &logbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, []string{"inventory"}, slog.New(slog.NewTextHandler(out, nil))) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})

	// What /readyz answers (internal/probe), as a client reads it.
	type readiness struct {
		Status       string
		Dependencies map[string]struct{ Status, Error string }
	}
	readyz := func(want int) readiness {
		var body readiness
		poll.Until(t, time.Minute, fmt.Sprintf("/readyz to answer %d", want), func() bool {
			res, err := http.Get("http://" + addr + "/readyz")
			if err != nil {
				return false
			}
			defer res.Body.Close()
			body = readiness{}
			return json.NewDecoder(res.Body).Decode(&body) == nil && res.StatusCode == want
		})
		return body
	}
	body := readyz(http.StatusServiceUnavailable)
	if nats := body.Dependencies["nats"]; body.Status == "ok" || nats.Status != "down" ||
		!strings.Contains(strings.ToLower(nats.Error), "authorization violation") || !strings.Contains(nats.Error, "INVENTORY_NATS_PASSWORD") {
		t.Errorf("/readyz: %+v", body)
	}
	time.Sleep(3 * time.Second) // more attempts to connect, more probes: still one log line
	log := out.String()
	if n := strings.Count(log, "nats authentication failed"); n != 1 {
		t.Errorf("logged the refusal %d times, want once:\n%s", n, log)
	}
	for _, want := range []string{"level=ERROR", "deploy/nats/auth.conf", "INVENTORY_NATS_PASSWORD", "TestAuthConfMatchesTheTable"} {
		if !strings.Contains(log, want) {
			t.Errorf("the log does not say %q:\n%s", want, log)
		}
	}
	if strings.Contains(log, password) {
		t.Errorf("the log shows the password:\n%s", log)
	}

	// The operator regenerates auth.conf and restarts the server.
	stop()
	serve(services.All)
	if body := readyz(http.StatusOK); body.Dependencies["nats"].Status != "up" {
		t.Errorf("/readyz after the server was mended: %+v", body)
	}
	poll.Until(t, time.Minute, "the log to say the credentials are accepted", func() bool {
		return strings.Contains(out.String(), "nats authentication succeeded")
	})
}

// runInventory runs the inventory service against natsURL until the test
// ends and returns its log once it is ready.
func runInventory(t *testing.T, natsURL, password string) *logbuf.Buffer {
	t.Helper()
	out, _ := runInventoryWith(t, map[string]string{"NATS_URL": natsURL, "INVENTORY_NATS_PASSWORD": password}, nil)
	return out
}

// runInventoryWith is runInventory with env (beside its database and
// address) and the configuration changed by tweak, when not nil; it
// returns the service's base URL too.
func runInventoryWith(t *testing.T, env map[string]string, tweak func(*config.Config)) (*logbuf.Buffer, string) {
	t.Helper()
	return startInventory(t, env, tweak, true)
}

// startInventory is runInventoryWith, returning once the service is ready
// when waitReady, else once it serves HTTP (/healthz).
func startInventory(t *testing.T, env map[string]string, tweak func(*config.Config), waitReady bool) (*logbuf.Buffer, string) {
	t.Helper()
	db := pgtest.NewDatabase(t, "shop_app_auth_")
	addr := freeAddr(t)
	env = maps.Clone(env)
	env["DATABASE_URL"], env["INVENTORY_ADDR"] = db.URL, addr
	cfg, err := LoadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	if tweak != nil {
		tweak(&cfg)
	}
	out := &logbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, []string{"inventory"}, slog.New(slog.NewTextHandler(out, nil))) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	if waitReady {
		wait, stopWaiting := context.WithTimeout(ctx, time.Minute)
		defer stopWaiting()
		if err := httpx.WaitReady(wait, nil, "http://"+addr); err != nil {
			t.Fatal(err)
		}
	} else {
		poll.Until(t, time.Minute, "/healthz", func() bool { return get200(t, "http://"+addr+"/healthz") != "" })
	}
	return out, "http://" + addr
}

// ensureEveryStream creates every stream of the shop, as the stream keeper
// does when a process starts, for tests that run the services' parts
// without Run (js may create streams).
func ensureEveryStream(ctx context.Context, js jetstream.JetStream, log *slog.Logger) error {
	cfg := config.Config{Registry: services.All, NATSReplicas: 1, StreamLimits: broker.DefaultLimits}
	newStreamKeeper(js, shopStreams(cfg), log).check(ctx)
	for _, w := range shopStreams(cfg) {
		if _, err := js.Stream(ctx, w.Name); err != nil {
			return fmt.Errorf("stream %s: %w", w.Name, err)
		}
	}
	return nil
}

// buildDomain builds the service called name as cfg configures it, over d.
func buildDomain(t *testing.T, cfg config.Config, name string, d registry.Deps) registry.Domain {
	t.Helper()
	build := cfg.Constructor(name)
	if build == nil {
		t.Fatalf("no service %q in the configuration", name)
	}
	dom, err := build(d)
	if err != nil {
		t.Fatal(err)
	}
	return dom
}

// A built service that runs other consumers than its entry declares does
// not start, and the error says where to declare them.
func TestCheckConsumersNamesTheRegistration(t *testing.T) {
	t.Parallel()
	_, js := natstest.New(t).Connect(t)
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cfg, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	e, _ := services.All.Get("payment")
	dom := buildDomain(t, cfg, e.Name, registry.Deps{Pool: pool, JetStream: js})
	e.Consumers = append(e.Consumers, registry.Consumer{Name: "payment-refunds", Stream: "ORDERS"})
	err = checkConsumers(e, dom)
	if err == nil || !strings.Contains(err.Error(), "services/payment/registration.go") || !strings.Contains(err.Error(), "payment-refunds") {
		t.Fatalf("checkConsumers with a declared consumer that does not run: %v, want an error naming it and the registration", err)
	}
}
