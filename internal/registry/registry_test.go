package registry_test

import (
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/services"
)

// An incomplete or inconsistent entry is an error at start-up that says
// what to add and where, never a silent default.
func TestValidateSaysWhatToAddAndWhere(t *testing.T) {
	t.Parallel()
	order, _ := services.All.Get("order")
	// A draft of a new service: a name no service, guide or test uses.
	draft := registry.Entry{Name: "draft", Schema: "draft", Stream: "DRAFT", Prefix: "draft", PoolSize: 8,
		Configure: func(*registry.Env) registry.NewFunc { return nil }}
	for name, tc := range map[string]struct {
		change func(*registry.Entry)
		want   []string
	}{
		"no address":        {func(e *registry.Entry) {}, []string{`"draft"`, "Addr", "services/draft/registration.go"}},
		"no migrations":     {func(e *registry.Entry) { e.Addr = ":8090" }, []string{"migrations/draft/"}},
		"a schema taken":    {func(e *registry.Entry) { e.Addr, e.Schema = ":8090", "orders" }, []string{`Schema "orders" is order's too`}},
		"an address taken":  {func(e *registry.Entry) { e.Addr = order.Addr }, []string{`Addr ":8081" is order's too`}},
		"no constructor":    {func(e *registry.Entry) { e.Addr, e.Configure = ":8090", nil }, []string{"no Configure"}},
		"an unknown stream": {func(e *registry.Entry) { e.Consumers = []registry.Consumer{{Name: "draft-points", Stream: "POINTS"}} }, []string{`reads stream "POINTS"`}},
		"a consumer's name": {func(e *registry.Entry) { e.Consumers = []registry.Consumer{{Name: "payment-orders", Stream: "ORDERS"}} }, []string{`consumer "payment-orders" is payment's too`}},
		"a check's service": {func(e *registry.Entry) {
			e.Checks = []registry.Check{{Name: "x", From: &registry.Query{Service: "points"}}}
		}, []string{`reads service "points"`}},
		"a name in capitals": {func(e *registry.Entry) { e.Name = "Draft" }, []string{"lower case"}},
		// A service's NATS user is named after it: these are the shop's own.
		"the audit user's name":    {func(e *registry.Entry) { e.Addr, e.Name = ":8090", "audit" }, []string{`service "audit"`, `Name "audit" is reserved`, "services/audit/registration.go"}},
		"the stream keeper's name": {func(e *registry.Entry) { e.Addr, e.Name = ":8090", "streams" }, []string{`service "streams"`, `Name "streams" is reserved`}},
		// Its user may publish to <Prefix>.>: into every reply inbox, or the server's APIs.
		"the inbox prefix":     {func(e *registry.Entry) { e.Addr, e.Prefix = ":8090", "_INBOX" }, []string{`service "draft"`, `Prefix "_INBOX" is reserved`}},
		"an underscore prefix": {func(e *registry.Entry) { e.Addr, e.Prefix = ":8090", "_draft" }, []string{`Prefix "_draft" is reserved`}},
		"the JetStream API":    {func(e *registry.Entry) { e.Addr, e.Prefix = ":8090", "$JS" }, []string{`Prefix "$JS" is reserved`}},
		"the system account":   {func(e *registry.Entry) { e.Addr, e.Prefix = ":8090", "$SYS" }, []string{`Prefix "$SYS" is reserved`}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := draft
			tc.change(&e)
			err := append(append(registry.Registry{}, services.All...), e).Validate()
			if err == nil {
				t.Fatal("Validate passed")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

func TestRegistryLookups(t *testing.T) {
	t.Parallel()
	if _, err := services.All.Get("nosuchservice"); err == nil || !strings.Contains(err.Error(), "unknown service") {
		t.Errorf("Get(nosuchservice) = %v, want an unknown-service error", err)
	}
	if e, ok := services.All.Owner("ORDERS"); !ok || e.Name != "order" {
		t.Errorf("Owner(ORDERS) = %s %v, want order", e.Name, ok)
	}
	var saga []string
	for _, r := range services.All.Readers() {
		if r.Saga {
			saga = append(saga, r.Service+"/"+r.Name)
		}
	}
	if len(saga) != 6 {
		t.Errorf("the saga's consumers are %v, want the six of docs/events.md", saga)
	}
	order, _ := services.All.Get("order")
	a := order.Access()
	if a.User != "order" || a.Stream != "ORDERS" || len(a.Subjects) != 1 || a.Subjects[0] != "orders.>" || len(a.Durables) != 3 {
		t.Errorf("order's access %+v", a)
	}
}

// Each setting is read once from its variable, a flag of the same name
// overrides it, a bad value is an error naming the variable, and a secret
// shows in neither the help nor the log.
func TestEnv(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"SHOP_WAIT": "90s", "SHOP_TOKEN": "s3cret"}
	env := registry.NewEnv(func(k string) string { return vars[k] })
	var (
		wait, delay time.Duration
		n           int64
		on          bool
		token, name string
	)
	env.Duration(&wait, "SHOP_WAIT", time.Minute, "how long")
	env.Duration(&delay, "SHOP_DELAY", 2*time.Second, "delay")
	env.Count(&n, "SHOP_COUNT", 3, "how many")
	env.Bool(&on, "SHOP_ON", false, "switch")
	env.Secret(&token, "SHOP_TOKEN", "", "a `token`")
	env.String(&name, "SHOP_NAME", "x", "a name")
	if err := env.Err(); err != nil {
		t.Fatal(err)
	}
	if wait != 90*time.Second || delay != 2*time.Second || n != 3 || on || token != "s3cret" || name != "x" {
		t.Fatalf("read %s %s %d %v %q %q", wait, delay, n, on, token, name)
	}
	if got := env.Vars(); strings.Join(got, " ") != "SHOP_WAIT SHOP_DELAY SHOP_COUNT SHOP_ON SHOP_TOKEN SHOP_NAME" {
		t.Errorf("Vars() = %v", got)
	}

	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	var help strings.Builder
	fs.SetOutput(&help)
	env.RegisterFlags(fs)
	if err := fs.Parse([]string{"-shop-delay", "5s", "-shop-on"}); err != nil {
		t.Fatal(err)
	}
	if delay != 5*time.Second || !on {
		t.Errorf("after the flags: delay %s, on %v", delay, on)
	}
	if err := fs.Parse([]string{"-shop-count", "-1"}); err == nil {
		t.Error("-shop-count -1: want an error")
	}
	fs.PrintDefaults()
	logged := env.LogValue().String()
	for what, s := range map[string]string{"help": help.String(), "log": logged} {
		if strings.Contains(s, "s3cret") {
			t.Errorf("the %s shows the secret: %s", what, s)
		}
	}
	if !strings.Contains(logged, "shop_token_set=true") || !strings.Contains(logged, "shop_wait=1m30s") {
		t.Errorf("log %s", logged)
	}
	if err := env.Set("SHOP_NAME", "y"); err != nil || name != "y" {
		t.Errorf("Set: %v, name %q", err, name)
	}
	if v, ok := env.Value("SHOP_WAIT"); !ok || v != 90*time.Second {
		t.Errorf("Value(SHOP_WAIT) = %v %v", v, ok)
	}
	if _, ok := env.Value("NOBODY"); ok {
		t.Error("Value of a setting no one declared")
	}
	if err := env.Set("NOBODY", "1"); err == nil {
		t.Error("Set of a setting no one declared: want an error")
	}

	bad := registry.NewEnv(func(k string) string {
		return map[string]string{"SHOP_WAIT": "soon", "SHOP_COUNT": "-2", "SHOP_ON": "yes please"}[k]
	})
	bad.Duration(&wait, "SHOP_WAIT", time.Minute, "")
	bad.Count(&n, "SHOP_COUNT", 1, "")
	bad.Bool(&on, "SHOP_ON", false, "")
	bad.Bool(&on, "SHOP_ON", false, "")
	err := bad.Err()
	for _, want := range []string{`SHOP_WAIT="soon"`, `SHOP_COUNT="-2"`, `SHOP_ON="yes please"`, "SHOP_ON is declared twice"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Err() = %v, want it to say %s", err, want)
		}
	}
}
