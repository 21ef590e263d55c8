package operator

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

func TestVerify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := shoptest.NewDatabaseURL(t)
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
	if !errors.Is(err, ErrViolations) {
		t.Fatalf("err = %v, want ErrViolations\n%s", err, out.String())
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
	dbURL := shoptest.NewDatabaseURL(t)
	ns, passwords := natstest.NewSecured(t, services.All.Access())
	_, keeper := ns.ConnectAs(t, broker.StreamsUser) // the only user that creates streams
	for _, a := range services.All.Access() {
		ns.Stream(t, keeper, a.Stream, a.Subjects...)
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
	dbURL := shoptest.NewDatabaseURL(t)
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
	if !errors.Is(err, ErrViolations) { // the republished event is pending now
		t.Fatalf("err = %v, want ErrViolations\n%s", err, out.String())
	}
	for _, want := range []string{"RECONCILE stuck_order order " + id + ": PENDING for 1h", "republished 1 lost events",
		"1 stuck orders, 0 unrefunded payments, 0 held reservations, 0 lost events; 1 events republished"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
}

// verify audits the streams: an event marked published that its stream
// does not hold is a violation naming it, `shop outbox republish --lost`
// marks it to be published again, and a NATS server that cannot be reached
// fails the audit instead of passing it.
func TestVerifyStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := shoptest.NewDatabaseURL(t)
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
	if !errors.Is(err, ErrViolations) {
		t.Fatalf("verify: err = %v, want ErrViolations\n%s", err, out)
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
		down := shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": "nats://" + shoptest.FreeAddr(t)})}
		out, _, err := down.run("verify")
		if !errors.Is(err, ErrNoShop) || !strings.Contains(err.Error(), "cannot reach NATS at nats://127.0.0.1:") ||
			!strings.Contains(err.Error(), "run this in the directory you ran `make demo` in") || out != "" {
			t.Errorf("verify without NATS: err = %v\n%s", err, out)
		}
		out, _, err = down.run("verify", "-streams=false")
		if !errors.Is(err, ErrViolations) || !strings.Contains(out, "skip invariant 3: the streams were not audited") ||
			strings.Contains(out, "not audited: cannot reach") {
			t.Errorf("verify -streams=false: err = %v\n%s", err, out)
		}
		if _, _, err := down.run("outbox", "republish", "--lost"); err == nil || !strings.Contains(err.Error(), "cannot reach NATS") {
			t.Errorf("republish --lost without NATS: err = %v", err)
		}
	})
}

// Where there is no shop (the demo stopped, the machine's own NATS on the
// address), verify says so in one line and fails, with no report of checks
// that had nothing to read.
func TestVerifyWithNoShop(t *testing.T) {
	t.Parallel()
	dbURL := shoptest.NewDatabaseURL(t)
	natsURL, _ := shopStreams(t)
	oneLine := func(t *testing.T, c shopCLI, want string) {
		t.Helper()
		out, errOut, err := c.run("verify")
		if !errors.Is(err, ErrNoShop) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("verify: err = %v, want ErrNoShop with %q", err, want)
		}
		if out != "" || errOut != "" {
			t.Errorf("verify printed more than its one line:\nstdout:\n%s\nstderr:\n%s", out, errOut)
		}
	}

	t.Run("no database on DATABASE_URL", func(t *testing.T) {
		oneLine(t, shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": natsURL})}, "does not exist")
	})
	t.Run("no schemas on DATABASE_URL", func(t *testing.T) {
		oneLine(t, shopCLI{t, env(map[string]string{"DATABASE_URL": pgtest.NewDatabase(t, "shop_empty_").URL, "NATS_URL": natsURL})},
			"the database has no schema inventory, orders, payment, fulfillment")
	})

	migrated := shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": natsURL})}
	migrated.ok("migrate")

	t.Run("a NATS server without the shop's streams", func(t *testing.T) {
		other := natstest.New(t)
		oneLine(t, shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": other.URL()})},
			"has none of the shop's streams")
	})

	t.Run("a NATS server without the shop's users", func(t *testing.T) {
		// A server of the machine with users of its own, none of them the shop's audit user.
		other, _ := natstest.NewSecuredFor(t, []broker.Access{{User: "someone", Stream: "THEIRS", Subjects: []string{"theirs.>"}}})
		oneLine(t, shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL, "NATS_URL": other.URL(), "AUDIT_NATS_PASSWORD": "a-password"})},
			"cannot reach NATS")
	})

	t.Run("the shop's server and schemas", func(t *testing.T) {
		if out := migrated.ok("verify"); !strings.Contains(out, "all invariants hold") {
			t.Errorf("verify:\n%s", out)
		}
	})
}
