package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/natstest"
	"github.com/shop-ref/shop/internal/pgtest"
	"github.com/shop-ref/shop/pkg/outbox"
)

// newDatabase returns the URL of a database that does not exist yet, on the
// test server (pgtest.URL), and drops it when the test ends. `shop` must
// create it: that is part of what these tests check.
func newDatabase(t *testing.T) string {
	t.Helper()
	u, err := url.Parse(pgtest.URL())
	if err != nil || u.Scheme == "" {
		t.Fatalf("test database URL must be a postgres:// URL: %v", err)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "shop_cmd_" + hex.EncodeToString(b[:])
	admin := *u
	admin.Path = "/postgres"
	u.Path = "/" + name
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, admin.String())
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		// FORCE: a pool of a stopped service may still hold a connection.
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	return u.String()
}

// env is a process environment for run.
func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

// versionTables lists the schemas of the database at dbURL that hold a goose
// version table, with the highest version applied in each.
func versionTables(t *testing.T, dbURL string) map[string]int64 {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT table_schema FROM information_schema.tables WHERE table_name = 'goose_db_version'`)
	if err != nil {
		t.Fatal(err)
	}
	schemas, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, s := range schemas {
		var v int64
		q := "SELECT max(version_id) FROM " + pgx.Identifier{s, "goose_db_version"}.Sanitize()
		if err := conn.QueryRow(ctx, q).Scan(&v); err != nil {
			t.Fatal(err)
		}
		got[s] = v
	}
	return got
}

var allSchemas = []string{"fulfillment", "inventory", "orders", "payment"}

func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	checkSchemas := func(t *testing.T, dbURL string) {
		t.Helper()
		got := versionTables(t, dbURL)
		schemas := make([]string, 0, len(got))
		for s, v := range got {
			schemas = append(schemas, s)
			if v < 2 {
				t.Errorf("schema %s: goose version %d, want at least 2 (the service's first migration)", s, v)
			}
		}
		slices.Sort(schemas)
		if !slices.Equal(schemas, allSchemas) {
			t.Errorf("goose_db_version tables in schemas %v, want one in each of %v", schemas, allSchemas)
		}
	}

	t.Run("creates the database and applies every schema, twice without error", func(t *testing.T) {
		t.Parallel()
		dbURL := newDatabase(t)
		for i := range 2 {
			if err := run(ctx, []string{"migrate"}, env(map[string]string{"DATABASE_URL": dbURL}), io.Discard, io.Discard); err != nil {
				t.Fatalf("migrate, run %d: %v", i+1, err)
			}
		}
		checkSchemas(t, dbURL)
	})

	t.Run("two processes at once on a fresh database", func(t *testing.T) {
		t.Parallel()
		dbURL := newDatabase(t)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i := range errs {
			wg.Go(func() {
				// The flag rather than the environment: both must work.
				errs[i] = run(ctx, []string{"migrate", "-database-url", dbURL}, env(nil), io.Discard, io.Discard)
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		checkSchemas(t, dbURL)
	})

	t.Run("named services only", func(t *testing.T) {
		t.Parallel()
		dbURL := newDatabase(t)
		if err := run(ctx, []string{"migrate", "-database-url", dbURL, "order", "payment"}, env(nil), io.Discard, io.Discard); err != nil {
			t.Fatal(err)
		}
		got := versionTables(t, dbURL)
		if len(got) != 2 || got["orders"] == 0 || got["payment"] == 0 {
			t.Errorf("version tables %v, want orders and payment only", got)
		}
	})

	t.Run("unknown service is refused before anything is applied", func(t *testing.T) {
		t.Parallel()
		err := run(ctx, []string{"migrate", "order", "shipping"}, env(nil), io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), `"shipping"`) {
			t.Fatalf("err = %v, want an unknown-service error naming shipping", err)
		}
	})
}

// shopStreams starts a NATS server with the shop's four streams, as the
// services create them, and returns its URL and a JetStream client.
func shopStreams(t *testing.T) (string, jetstream.JetStream) {
	t.Helper()
	ns := natstest.New(t)
	_, js := ns.Connect(t)
	for name, subjects := range map[string]string{"ORDERS": "orders.>", "INVENTORY": "inventory.>", "PAYMENT": "payment.>", "FULFILLMENT": "fulfillment.>"} {
		ns.Stream(t, js, name, subjects)
	}
	return ns.URL(), js
}

func TestVerify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := newDatabase(t)
	natsURL, _ := shopStreams(t)
	vars := env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": natsURL})
	if err := run(ctx, []string{"migrate"}, vars, io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := run(ctx, []string{"verify"}, vars, &out, io.Discard); err != nil {
		t.Fatalf("verify on an empty shop: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "all invariants hold") {
		t.Fatalf("report:\n%s", out.String())
	}

	// Stock held by no reservation, and an event intent never published.
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `
		INSERT INTO inventory.stock (sku, on_hand, reserved, sold, price, supplied) VALUES ('SKU-X', 5, 2, 0, 100, 5);
		INSERT INTO orders.outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version, subject, payload)
		VALUES (gen_random_uuid(), 'order', 'o-1', 1, 'OrderCreated', 1, 'orders.o-1.OrderCreated', '{}');
		INSERT INTO orders.outbox_sequences VALUES ('order', 'o-1', 1)`); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	err = run(ctx, []string{"verify"}, vars, &out, io.Discard)
	if !errors.Is(err, errViolations) {
		t.Fatalf("err = %v, want errViolations\n%s", err, out.String())
	}
	for _, want := range []string{"SKU-X: reserved 2 but reservations hold 0", "is not yet published", "o-1 has 0 order and 1 OrderCreated events"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
}

// On a server that requires the shop's users, verify audits the streams as
// the read-only audit user, with AUDIT_NATS_PASSWORD; without it the server
// refuses it and verify says it could not reach NATS.
func TestVerifyAsTheAuditUser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := newDatabase(t)
	ns, passwords := natstest.NewSecured(t)
	for _, a := range broker.Services {
		_, js := ns.ConnectAs(t, a.User)
		ns.Stream(t, js, a.Stream, a.Subjects...)
	}
	vars := env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": ns.URL(), "AUDIT_NATS_PASSWORD": passwords[broker.AuditUser]})
	if err := run(ctx, []string{"migrate"}, vars, io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := run(ctx, []string{"verify"}, vars, &out, io.Discard); err != nil || !strings.Contains(out.String(), "all invariants hold") {
		t.Fatalf("verify as the audit user: %v\n%s", err, out.String())
	}
	out.Reset()
	anonymous := env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": ns.URL()})
	err := run(ctx, []string{"verify"}, anonymous, &out, io.Discard)
	if err == nil || !strings.Contains(out.String()+err.Error(), "cannot reach NATS") {
		t.Fatalf("verify without the password: %v\n%s", err, out.String())
	}
}

// verify -repair reconciles first: a stuck order is reported, and its
// event that no consumer processed is republished.
func TestVerifyRepair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := newDatabase(t)
	natsURL, js := shopStreams(t)
	vars := env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": natsURL})
	if err := run(ctx, []string{"migrate"}, vars, io.Discard, io.Discard); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	const id = "0193c7a2-0000-7000-8000-000000000001"
	if _, err := conn.Exec(ctx, `
		INSERT INTO orders.orders (order_id, customer_id, status, total, created_at, updated_at)
		VALUES ('`+id+`', 'c', 'PENDING', 100, now() - interval '1 hour', now() - interval '1 hour');
		INSERT INTO orders.outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version,
		                           subject, payload, published_at)
		VALUES (gen_random_uuid(), 'order', '`+id+`', 1, 'OrderCreated', 1, 'orders.`+id+`.OrderCreated', '{}',
		        now() - interval '1 hour');
		INSERT INTO orders.outbox_sequences VALUES ('order', '`+id+`', 1)`); err != nil {
		t.Fatal(err)
	}
	// The stream has the event: it was lost on the way to the consumer,
	// not by the broker.
	var ev string
	if err := conn.QueryRow(ctx, `SELECT event_id::text FROM orders.outbox`).Scan(&ev); err != nil {
		t.Fatal(err)
	}
	natstest.Publish(t, js, natstest.Event{ID: uuid.MustParse(ev), Prefix: "orders", AggregateType: "order",
		AggregateID: id, Type: "OrderCreated", Seq: 1, Payload: map[string]string{}}.Msg(t))
	var out strings.Builder
	err = run(ctx, []string{"verify", "-repair"}, vars, &out, io.Discard)
	if !errors.Is(err, errViolations) { // the republished event is pending now
		t.Fatalf("err = %v, want errViolations\n%s", err, out.String())
	}
	for _, want := range []string{"RECONCILE stuck_order order " + id + ": PENDING for 1h", "republished 1 lost events",
		"1 stuck orders, 0 unrefunded payments, 0 held reservations, 0 lost events; 1 events republished"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
}

func TestUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args    []string
		wantErr error
	}{
		{nil, errUsage},
		{[]string{"shipping"}, errUsage},
		{[]string{"outbox"}, errUsage},
		{[]string{"loadgen", "-orders", "0"}, errUsage},
		{[]string{"trace"}, errUsage},
		{[]string{"trace", "not-an-order-id"}, errUsage},
		{[]string{"trace", "-h"}, flag.ErrHelp},
		{[]string{"-h"}, nil},
		{[]string{"order", "-h"}, flag.ErrHelp}, // main exits 0 on it
		{[]string{"order", "-no-such-flag"}, errUsage},
		{[]string{"all", "extra"}, errUsage},
		{[]string{"order", "-demo"}, errUsage},     // another command's flag is refused, not ignored
		{[]string{"verify", "-roles"}, errUsage},   // likewise
		{[]string{"migrate", "-repair"}, errUsage}, // likewise
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			var out strings.Builder
			err := run(context.Background(), tc.args, env(nil), &out, &out)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("err = %v, want %v", err, tc.wantErr)
			}
			if out.Len() == 0 {
				t.Error("printed nothing; want usage or an explanation")
			}
		})
	}
}

// freeAddr returns a loopback address with a port nobody listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestAll(t *testing.T) {
	t.Parallel()
	dbURL := newDatabase(t)
	ns := natstest.New(t)
	vars := map[string]string{"DATABASE_URL": dbURL, "NATS_URL": ns.URL(), "DASHBOARD_ADDR": freeAddr(t)}
	addrs := map[string]string{}
	for _, name := range []string{"ORDER", "INVENTORY", "PAYMENT", "FULFILLMENT"} {
		addrs[name] = freeAddr(t)
		vars[name+"_ADDR"] = addrs[name]
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"all"}, env(vars), io.Discard, io.Discard) }()

	for name, addr := range addrs {
		waitFor(t, name+" ready", 30*time.Second, func() bool {
			select {
			case err := <-done:
				t.Fatalf("shop all returned before it was ready: %v", err)
			default:
			}
			resp, err := http.Get("http://" + addr + "/readyz")
			if err != nil {
				return false
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK
		})
	}

	_, js := ns.Connect(t)
	for _, stream := range []string{"ORDERS", "INVENTORY", "PAYMENT", "FULFILLMENT"} {
		waitFor(t, "stream "+stream, 10*time.Second, func() bool {
			_, err := js.Stream(ctx, stream)
			return err == nil
		})
	}

	t.Run("the order relay publishes a committed event", func(t *testing.T) {
		pool, err := database.NewPool(ctx, dbURL, "orders", 2)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		var w outbox.Writer
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return w.Add(ctx, tx, outbox.Event{
				AggregateType: "order", AggregateID: "o-1", Type: "OrderCreated",
				Subject: "orders.o-1.OrderCreated", Payload: map[string]string{"order_id": "o-1"},
			})
		})
		if err != nil {
			t.Fatal(err)
		}
		stream, err := js.Stream(ctx, "ORDERS")
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the event on ORDERS", 15*time.Second, func() bool {
			msg, err := stream.GetLastMsgForSubject(ctx, "orders.o-1.OrderCreated")
			return err == nil && msg.Header.Get("Event-Type") == "OrderCreated"
		})
	})

	t.Run("stops cleanly when the context ends", func(t *testing.T) {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("run returned %v, want nil after a clean shutdown", err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("run did not return within 20s of cancel")
		}
		for name, addr := range addrs {
			if resp, err := http.Get("http://" + addr + "/healthz"); err == nil {
				resp.Body.Close()
				t.Errorf("%s still answers on %s after shutdown", name, addr)
			}
		}
	})
}

// syncBuffer is an io.Writer the test reads while the shop writes to it.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestAllDemo(t *testing.T) {
	t.Parallel()
	// Port 0: each listener takes a free port as it binds, so no other
	// process can take it between a test's choice and the bind.
	demoVars := func(t *testing.T) map[string]string {
		vars := map[string]string{"DATABASE_URL": newDatabase(t), "NATS_URL": natstest.New(t).URL(), "DASHBOARD_ADDR": "127.0.0.1:0"}
		for _, name := range []string{"ORDER", "INVENTORY", "PAYMENT", "FULFILLMENT"} {
			vars[name+"_ADDR"] = "127.0.0.1:0"
		}
		return vars
	}

	t.Run("prints the dashboard address it really bound", func(t *testing.T) {
		t.Parallel()
		vars := demoVars(t)
		taken, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer taken.Close()
		vars["DASHBOARD_ADDR"] = taken.Addr().String()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var out syncBuffer
		done := make(chan error, 1)
		go func() { done <- run(ctx, []string{"all", "-demo"}, env(vars), &out, io.Discard) }()
		waitFor(t, "the demo banner", time.Minute, func() bool {
			select {
			case err := <-done:
				t.Fatalf("shop all -demo returned: %v", err)
			default:
			}
			return strings.Contains(out.String(), "The demo shop is up")
		})
		_, after, ok := strings.Cut(out.String(), "dashboard: ")
		dashboard := strings.TrimSpace(strings.SplitN(after, "\n", 2)[0])
		if !ok || dashboard == "http://"+vars["DASHBOARD_ADDR"] {
			t.Fatalf("banner names dashboard %q, which another listener holds:\n%s", dashboard, out.String())
		}
		res, err := http.Get(dashboard + "/api/state")
		if err != nil {
			t.Fatalf("the dashboard the banner names: %v", err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			t.Fatalf("the dashboard the banner names answers %s", res.Status)
		}
		conn, err := pgx.Connect(ctx, vars["DATABASE_URL"])
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var onHand int
		if err := conn.QueryRow(ctx, `SELECT on_hand FROM inventory.stock WHERE sku = 'SKU-1'`).Scan(&onHand); err != nil || onHand == 0 {
			t.Fatalf("SKU-1 not stocked by the demo: %d, %v", onHand, err)
		}
	})

	t.Run("stops before seeding when a listener cannot bind", func(t *testing.T) {
		t.Parallel()
		vars := demoVars(t)
		// Another process holds the inventory address and answers every
		// request, as an older shop left running would.
		var requests sync.Map
		other := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			requests.Store(r.Method+" "+r.URL.Path, true)
			w.WriteHeader(http.StatusOK)
		})}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		vars["INVENTORY_ADDR"] = ln.Addr().String()
		go func() { _ = other.Serve(ln) }()
		defer other.Close()

		var out syncBuffer
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = run(ctx, []string{"all", "-demo"}, env(vars), &out, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "listen") || !strings.Contains(err.Error(), vars["INVENTORY_ADDR"]) {
			t.Fatalf("run returned %v, want the inventory service's listen error", err)
		}
		if strings.Contains(out.String(), "The demo shop is up") {
			t.Errorf("printed the banner although inventory could not listen:\n%s", out.String())
		}
		requests.Range(func(k, _ any) bool {
			t.Errorf("the demo sent %v to the other process on the inventory address", k)
			return true
		})
	})
}

// verify audits the streams: an event marked published that its stream
// does not hold is a violation naming it, `shop outbox republish --lost`
// marks it to be published again, and a NATS server that cannot be reached
// fails the audit instead of passing it.
func TestVerifyStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := newDatabase(t)
	natsURL, js := shopStreams(t)
	cli := shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": natsURL})}
	cli.ok("migrate")
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// Two SKUs' ProductUpdated, published; the broker kept only the first.
	const kept, lost = "0193c7a2-0000-7000-8000-0000000000a1", "0193c7a2-0000-7000-8000-0000000000a2"
	if _, err := conn.Exec(ctx, `
		INSERT INTO inventory.outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version,
		                              subject, payload, occurred_at, published_at)
		VALUES ('`+kept+`', 'product', 'SKU-1', 1, 'ProductUpdated', 1, 'inventory.SKU-1.ProductUpdated', '{}',
		        now() - interval '1 minute', now() - interval '1 minute'),
		       ('`+lost+`', 'product', 'SKU-2', 1, 'ProductUpdated', 1, 'inventory.SKU-2.ProductUpdated', '{}',
		        now() - interval '1 minute', now() - interval '1 minute');
		INSERT INTO inventory.outbox_sequences VALUES ('product', 'SKU-1', 1), ('product', 'SKU-2', 1);
		INSERT INTO orders.processed_events (consumer_name, event_id) VALUES
		       ('order-inventory', '`+kept+`'), ('order-inventory', '`+lost+`')`); err != nil {
		t.Fatal(err)
	}
	natstest.Publish(t, js, natstest.Event{ID: uuid.MustParse(kept), Prefix: "inventory", AggregateType: "product",
		AggregateID: "SKU-1", Type: "ProductUpdated", Seq: 1, Payload: map[string]string{}}.Msg(t))

	out, _, err := cli.run("verify")
	if !errors.Is(err, errViolations) {
		t.Fatalf("verify: err = %v, want errViolations\n%s", err, out)
	}
	want := "inventory: ProductUpdated " + lost + " (product SKU-2, seq 1)"
	if !strings.Contains(out, "FAIL invariant 3: inventory: stream INVENTORY holds every event marked published") ||
		!strings.Contains(out, want) || strings.Contains(out, kept) || !strings.Contains(out, "1 violations") {
		t.Fatalf("report does not name exactly the lost event (%s):\n%s", want, out)
	}

	var res struct {
		Republished int `json:"republished"`
		Lost        []struct {
			Service, EventType, AggregateID string
			EventID                         uuid.UUID `json:"event_id"`
			Republished                     bool      `json:"republished"`
		} `json:"lost"`
		Services []struct {
			Service   string `json:"service"`
			Published int    `json:"published"`
			Scanned   int    `json:"scanned"`
		} `json:"services"`
	}
	cli.json(&res, "outbox", "republish", "--lost", "--json", "--service", "inventory")
	if res.Republished != 1 || len(res.Lost) != 1 || res.Lost[0].EventID.String() != lost || !res.Lost[0].Republished ||
		len(res.Services) != 1 || res.Services[0].Published != 2 || res.Services[0].Scanned != 1 {
		t.Fatalf("republish --lost: %+v", res)
	}
	var pending bool
	if err := conn.QueryRow(ctx, `SELECT published_at IS NULL FROM inventory.outbox WHERE event_id = $1`, lost).Scan(&pending); err != nil || !pending {
		t.Fatalf("the lost event is not pending again (%v, %v)", pending, err)
	}
	// Pending now, so no longer looked for in the stream: its relay sends it.
	if out := cli.ok("outbox", "republish", "--lost"); !strings.Contains(out, "inventory: stream INVENTORY: 1 published events looked for, 1 messages read, 0 lost") ||
		!strings.Contains(out, "total: 0 lost event(s)") {
		t.Errorf("second republish --lost:\n%s", out)
	}
	if _, _, err := cli.run("outbox", "republish"); !errors.Is(err, errUsage) {
		t.Errorf("republish without --lost: err = %v, want a usage error", err)
	}

	t.Run("NATS unreachable", func(t *testing.T) {
		down := shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": "nats://" + freeAddr(t)})}
		out, _, err := down.run("verify")
		if !errors.Is(err, errViolations) || !strings.Contains(out, "FAIL invariant 3: every stream holds every event marked published") ||
			!strings.Contains(out, "not audited: cannot reach NATS at nats://127.0.0.1:") {
			t.Errorf("verify without NATS: err = %v\n%s", err, out)
		}
		out, _, err = down.run("verify", "-streams=false")
		if !errors.Is(err, errViolations) || !strings.Contains(out, "skip invariant 3: the streams were not audited") ||
			strings.Contains(out, "not audited: cannot reach") {
			t.Errorf("verify -streams=false: err = %v\n%s", err, out)
		}
		if _, _, err := down.run("outbox", "republish", "--lost"); err == nil || !strings.Contains(err.Error(), "cannot reach NATS") {
			t.Errorf("republish --lost without NATS: err = %v", err)
		}
	})
}
