package operator

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// inSchema connects to the database at dbURL with search_path set to
// schema, where the libraries' read functions find their tables; closed
// when the test ends.
func inSchema(t *testing.T, dbURL, schema string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["search_path"] = schema
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// onlyDeadLetter returns consumer's one open dead letter.
func onlyDeadLetter(t *testing.T, db inbox.DB, consumer string) inbox.DeadLetter {
	t.Helper()
	dead, err := inbox.ListDeadLetters(context.Background(), db, consumer, 10)
	if err != nil || len(dead) != 1 {
		t.Fatalf("dead letters of %s: %d (%v), want 1", consumer, len(dead), err)
	}
	return dead[0]
}

func statusOf(t *testing.T, c shopCLI) map[string]serviceStatus {
	t.Helper()
	var list []serviceStatus
	c.json(&list, "outbox", "status", "--json")
	m := map[string]serviceStatus{}
	for _, s := range list {
		m[s.Service] = s
	}
	for _, name := range services.All.Names() {
		if _, ok := m[name]; !ok {
			t.Fatalf("status lacks service %s: %+v", name, list)
		}
	}
	if len(m) != len(services.All) {
		t.Fatalf("status lists %d services, want the %d of services.All: %+v", len(m), len(services.All), list)
	}
	return m
}

func TestOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := shoptest.NewDatabaseURL(t)
	cli := shopCLI{t, env(map[string]string{"DATABASE_URL": dbURL})}
	cli.ok("migrate")

	t.Run("status of an empty shop", func(t *testing.T) {
		out := cli.ok("outbox", "status")
		for _, want := range append([]string{"SERVICE", "PENDING", "OLDEST PENDING", "DEAD LETTERS"}, services.All.Names()...) {
			if !strings.Contains(out, want) {
				t.Errorf("status lacks %q:\n%s", want, out)
			}
		}
		for name, s := range statusOf(t, cli) {
			if s.Pending != 0 || s.Dead != 0 || s.DeadLetters != 0 || s.OldestPendingSeconds != 0 {
				t.Errorf("%s: %+v, want all zero", name, s)
			}
		}
	})

	// A slot for the order service's outbox, as a relay in cdc mode makes
	// it: shown with its WAL, the other services without one.
	t.Run("status of a replication slot", func(t *testing.T) {
		orders := inSchema(t, dbURL, "orders")
		var database string
		if err := orders.QueryRow(ctx, `SELECT current_database()`).Scan(&database); err != nil {
			t.Fatal(err)
		}
		slot := outbox.SlotName(database, "orders")
		// Its publication first, as a relay makes them: a slot without one
		// (even while it is being made) is an orphan that other tests'
		// clean-up drops, terminating the backend that makes it.
		if _, err := orders.Exec(ctx, "CREATE PUBLICATION "+pgx.Identifier{slot}.Sanitize()+" FOR TABLE "+
			pgx.Identifier{"orders", "outbox"}.Sanitize()+" WITH (publish = 'insert')"); err != nil {
			t.Fatal(err)
		}
		if _, err := orders.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := outbox.DropSlot(ctx, orders, slot); err != nil {
				t.Error(err)
			}
		}()
		for name, s := range statusOf(t, cli) {
			switch {
			case name == "order" && (s.Slot == nil || s.Slot.Name != slot || s.Slot.Active || s.Slot.WALStatus != "reserved" ||
				s.Slot.LagBytes < 0 || s.Slot.SafeWALSizeBytes == 0):
				t.Errorf("order's slot: %+v, want %s, inactive, reserved", s.Slot, slot)
			case name != "order" && s.Slot != nil:
				t.Errorf("%s's slot: %+v, want none", name, s.Slot)
			}
		}
		out := cli.ok("outbox", "status")
		for _, want := range []string{"SLOT", "WAL STATUS", "LAG AGE", "SAFE WAL LEFT", slot, "reserved"} {
			if !strings.Contains(out, want) {
				t.Errorf("status lacks %q:\n%s", want, out)
			}
		}
	})
	if out := cli.ok("outbox", "status"); strings.Contains(out, "WAL STATUS") {
		t.Errorf("status shows a slot table with no slot:\n%s", out)
	}

	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// What the libraries' APIs read, in one service's schema.
	orders, payment := inSchema(t, dbURL, "orders"), inSchema(t, dbURL, "payment")
	const (
		deadID      = "0193a6c2-0000-7000-8000-000000000001"
		publishedID = "0193a6c2-0000-7000-8000-000000000002"
	)
	if _, err := conn.Exec(ctx, `
		INSERT INTO orders.outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version,
		                           subject, payload, headers, attempts, last_error, dead_at)
		VALUES ('`+deadID+`', 'order', 'o-1', 1, 'OrderCreated', 1, 'orders.o-1.OrderCreated',
		        '{"order_id":"o-1","total":1999}', '{"traceparent":"00-abc-def-01"}', 10, 'nats: no responders', now());
		INSERT INTO orders.outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version,
		                           subject, payload, published_at)
		VALUES ('`+publishedID+`', 'order', 'o-2', 1, 'OrderCreated', 1, 'orders.o-2.OrderCreated', '{"order_id":"o-2"}', now());
		INSERT INTO payment.dead_letters (consumer_name, stream, stream_seq, subject, headers, payload, event_id,
		                                  error, attempts, first_failed_at, last_failed_at)
		VALUES ('payment-orders', 'ORDERS', 7, 'orders.o-1.OrderAwaitingPayment', '{"Event-Type":["OrderAwaitingPayment"]}',
		        '{"order_id":"o-1"}', gen_random_uuid(), 'handler: boom', 5, now(), now())`); err != nil {
		t.Fatal(err)
	}

	t.Run("status counts the dead event and the dead letter", func(t *testing.T) {
		st := statusOf(t, cli)
		if o := st["order"]; o.Pending != 0 || o.Dead != 1 || o.DeadLetters != 0 {
			t.Errorf("order: %+v, want 0 pending, 1 dead", o)
		}
		if p := st["payment"]; p.DeadLetters != 1 || p.Dead != 0 {
			t.Errorf("payment: %+v, want 1 dead letter", p)
		}
	})

	t.Run("dead lists the dead event with its id", func(t *testing.T) {
		out := cli.ok("outbox", "dead")
		if !strings.Contains(out, deadID) || !strings.Contains(out, "nats: no responders") || strings.Contains(out, publishedID) {
			t.Errorf("dead:\n%s", out)
		}
		var evs []eventJSON
		cli.json(&evs, "outbox", "dead", "--service", "order", "--json")
		if len(evs) != 1 || evs[0].EventID.String() != deadID || evs[0].State != "dead" {
			t.Errorf("dead --json: %+v", evs)
		}
		if out := cli.ok("outbox", "dead", "--service", "payment"); !strings.Contains(out, "no dead events") {
			t.Errorf("dead --service payment:\n%s", out)
		}
		if _, _, err := cli.run("outbox", "dead", "--consumer", "payment-orders"); !errors.Is(err, errUsage) {
			t.Errorf("dead --consumer: %v, want a usage error (no consumer owns an outbox's dead events)", err)
		}
	})

	t.Run("show", func(t *testing.T) {
		out := cli.ok("outbox", "show", deadID)
		for _, want := range []string{deadID, "order (schema orders)", "dead", "OrderCreated", "nats: no responders",
			"traceparent: 00-abc-def-01", "\"total\": 1999"} {
			if !strings.Contains(out, want) {
				t.Errorf("show lacks %q:\n%s", want, out)
			}
		}
		var ev eventJSON
		cli.json(&ev, "outbox", "show", deadID, "--json") // a flag after the argument
		if ev.Service != "order" || ev.State != "dead" || ev.AggregateID != "o-1" || ev.Attempts != 10 ||
			ev.Headers["traceparent"] == "" || compact(ev.Payload) != `{"order_id":"o-1","total":1999}` {
			t.Errorf("show --json: %+v", ev)
		}
		_, _, err := cli.run("outbox", "show", "0193a6c2-0000-7000-8000-0000000000ff")
		if err == nil || errors.Is(err, errUsage) || !strings.Contains(err.Error(), "no outbox") {
			t.Errorf("show of an unknown event: err = %v, want a plain not-found failure", err)
		}
	})

	t.Run("requeue", func(t *testing.T) {
		var res map[string]any
		cli.json(&res, "outbox", "requeue", "--json", deadID)
		if res["state"] != "pending" || res["previous_state"] != "dead" {
			t.Errorf("requeue --json: %v", res)
		}
		st := statusOf(t, cli)
		if o := st["order"]; o.Pending != 1 || o.Dead != 0 {
			t.Errorf("after requeue, order: %+v, want 1 pending, 0 dead", o)
		}
		if rec, err := outbox.Get(ctx, orders, uuid.MustParse(deadID)); err != nil || rec.Attempts != 0 {
			t.Errorf("attempts after requeue = %d (%v), want 0", rec.Attempts, err)
		}
		if !strings.Contains(cli.ok("outbox", "status"), "order") {
			t.Error("status table lost the order row")
		}
		// An already published event is not requeued: replay is the tool.
		_, _, err := cli.run("outbox", "requeue", publishedID)
		if err == nil || !strings.Contains(err.Error(), "replay") {
			t.Errorf("requeue of a published event: err = %v, want a hint to replay", err)
		}
	})

	t.Run("replay --aggregate", func(t *testing.T) {
		out := cli.ok("outbox", "replay", "--service", "order", "--aggregate", "o-2")
		if !strings.Contains(out, "order: 1 published event(s)") {
			t.Errorf("replay output:\n%s", out)
		}
		if rec, err := outbox.Get(ctx, orders, uuid.MustParse(publishedID)); err != nil || rec.PublishedAt != nil {
			t.Errorf("after replay published at %v (%v), want not published", rec.PublishedAt, err)
		}
		// Nothing published is left in o-2: a second replay finds nothing.
		var res struct {
			Republished int `json:"republished"`
		}
		cli.json(&res, "outbox", "replay", "--json", "--service", "orders", "--aggregate", "o-2")
		if res.Republished != 0 {
			t.Errorf("second replay republished %d, want 0", res.Republished)
		}
		if _, err := conn.Exec(ctx, `UPDATE orders.outbox SET published_at = now()`); err != nil {
			t.Fatal(err)
		}
		cli.json(&res, "outbox", "replay", "--json", "--service", "all", "--since", "1h")
		if res.Republished != 2 {
			t.Errorf("replay --since 1h republished %d, want 2", res.Republished)
		}
	})

	t.Run("dead letters", func(t *testing.T) {
		out := cli.ok("outbox", "dead-letters", "list")
		for _, want := range []string{"payment", "payment-orders", "orders.o-1.OrderAwaitingPayment", "handler: boom"} {
			if !strings.Contains(out, want) {
				t.Errorf("dead-letters list lacks %q:\n%s", want, out)
			}
		}
		var dls []deadLetterJSON
		cli.json(&dls, "outbox", "dead-letters", "list", "--json", "--service", "payment", "--consumer", "payment-orders")
		if len(dls) != 1 || dls[0].Service != "payment" || dls[0].StreamSeq != 7 || dls[0].EventID == nil ||
			compact(dls[0].Payload) != `{"order_id":"o-1"}` {
			t.Fatalf("dead-letters list --json: %+v", dls)
		}
		cli.json(&dls, "outbox", "dead-letters", "list", "--json", "--consumer", "nobody")
		if len(dls) != 0 {
			t.Errorf("list --consumer nobody: %+v, want none", dls)
		}
		id := onlyDeadLetter(t, payment, "payment-orders").ID
		idArg := jsonNumber(id)
		if out := cli.ok("outbox", "dead-letters", "requeue", idArg, "--service", "payment"); !strings.Contains(out, "requeued dead letter") {
			t.Errorf("requeue output: %s", out)
		}
		if dl := onlyDeadLetter(t, payment, "payment-orders"); dl.ID != id || dl.RequeuedAt == nil {
			t.Errorf("after the requeue: dead letter %d requeued at %v, want %d requeued", dl.ID, dl.RequeuedAt, id)
		}
		if _, _, err := cli.run("outbox", "dead-letters", "requeue", "999999", "--service", "order"); err == nil || errors.Is(err, errUsage) {
			t.Errorf("requeue of a missing dead letter: err = %v, want a failure (exit 1)", err)
		}
	})

	t.Run("dead letters: discard with a reason", func(t *testing.T) {
		id := onlyDeadLetter(t, payment, "payment-orders").ID
		idArg := jsonNumber(id)
		if _, _, err := cli.run("outbox", "dead-letters", "discard", idArg, "--service", "payment"); !errors.Is(err, errUsage) {
			t.Errorf("discard without --reason: %v, want a usage error", err)
		}
		if out := cli.ok("outbox", "dead-letters", "discard", idArg, "--service", "payment", "--reason", "garbage"); !strings.Contains(out, "discarded dead letter") {
			t.Errorf("discard output: %s", out)
		}
		if p := statusOf(t, cli)["payment"]; p.DeadLetters != 0 {
			t.Errorf("payment after the discard: %+v, want no open dead letter", p)
		}
		var reason string
		if err := conn.QueryRow(ctx, `SELECT discard_reason FROM payment.dead_letters WHERE id = $1`, id).Scan(&reason); err != nil || reason != "garbage" {
			t.Errorf("discard reason %q (%v), want the row kept with it", reason, err)
		}
	})

	t.Run("parked: status, list, discard", func(t *testing.T) {
		const parkedID = "0193a6c2-0000-7000-8000-0000000000aa"
		if _, err := conn.Exec(ctx, `INSERT INTO inventory.inbox_parked (consumer_name, source, aggregate_type, aggregate_id,
			aggregate_seq, event_id, stream, stream_seq, subject, headers, payload, parked_at)
			VALUES ('inventory-orders', 'orders', 'order', 'o-9', 3, '`+parkedID+`', 'ORDERS', 42, 'orders.o-9.OrderPaid',
			        '{"Event-Type":["OrderPaid"]}', '{"order_id":"o-9"}', now() - interval '90 seconds')`); err != nil {
			t.Fatal(err)
		}
		if inv := statusOf(t, cli)["inventory"]; inv.Parked != 1 || inv.OldestParkedSeconds < 90 {
			t.Errorf("inventory status: %+v, want 1 parked, 90 s old", inv)
		}
		if out := cli.ok("outbox", "status"); !strings.Contains(out, "PARKED") || !strings.Contains(out, "CONFLICTS") || !strings.Contains(out, "RETRYING") {
			t.Errorf("status lacks the parked and conflict columns:\n%s", out)
		}
		out := cli.ok("outbox", "parked", "list")
		for _, want := range []string{"inventory-orders", parkedID, "orders.o-9.OrderPaid"} {
			if !strings.Contains(out, want) {
				t.Errorf("parked list lacks %q:\n%s", want, out)
			}
		}
		var list []parkedJSON
		cli.json(&list, "outbox", "parked", "list", "--json", "--service", "inventory")
		if len(list) != 1 || list[0].Seq != 3 || list[0].WaitsFor != 1 || list[0].StreamSeq != 42 {
			t.Fatalf("parked list --json: %+v", list)
		}
		if _, _, err := cli.run("outbox", "parked", "discard", parkedID, "--service", "inventory", "--reason", "x"); !errors.Is(err, errUsage) {
			t.Errorf("discard without --consumer: %v, want a usage error", err)
		}
		cli.ok("outbox", "parked", "discard", parkedID, "--service", "inventory", "--consumer", "inventory-orders", "--reason", "forged")
		if out := cli.ok("outbox", "parked", "list"); !strings.Contains(out, "no parked events") {
			t.Errorf("parked list after the discard:\n%s", out)
		}
		if _, _, err := cli.run("outbox", "parked", "discard", parkedID, "--service", "inventory", "--consumer", "inventory-orders",
			"--reason", "again"); err == nil || errors.Is(err, errUsage) {
			t.Errorf("a second discard: %v, want a failure (exit 1)", err)
		}
	})

	t.Run("bad arguments", func(t *testing.T) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{[]string{"outbox"}, "Usage"},
			{[]string{"outbox", "frobnicate"}, "unknown command"},
			{[]string{"outbox", "status", "extra"}, "unexpected arguments"},
			{[]string{"outbox", "status", "--service", "shipping"}, "unknown service"},
			{[]string{"outbox", "status", "--no-such-flag"}, "not defined"},
			{[]string{"outbox", "show"}, "want <event-id>"},
			{[]string{"outbox", "show", "not-a-uuid"}, "not an event id"},
			{[]string{"outbox", "requeue", deadID, publishedID}, "want <event-id>"},
			{[]string{"outbox", "replay", "--service", "order"}, "--since T or --aggregate ID"},
			{[]string{"outbox", "replay", "--aggregate", "o-1"}, "--service is required"},
			{[]string{"outbox", "replay", "--service", "order", "--since", "yesterday"}, "RFC 3339"},
			{[]string{"outbox", "dead-letters"}, "list, requeue or discard"},
			{[]string{"outbox", "dead-letters", "purge"}, "unknown command"},
			{[]string{"outbox", "dead-letters", "requeue", "1"}, "--service is required"},
			{[]string{"outbox", "dead-letters", "requeue", "abc", "--service", "payment"}, "not a dead letter id"},
			{[]string{"outbox", "dead-letters", "list", "--limit", "0"}, "--limit"},
		} {
			_, errOut, err := cli.run(tc.args...)
			if !errors.Is(err, errUsage) {
				t.Errorf("shop %s: err = %v, want errUsage", strings.Join(tc.args, " "), err)
				continue
			}
			if !strings.Contains(errOut, tc.want) {
				t.Errorf("shop %s: stderr %q lacks %q", strings.Join(tc.args, " "), errOut, tc.want)
			}
		}
		var out strings.Builder
		if err := run(ctx, []string{"outbox", "-h"}, env(nil), &out, io.Discard); err != nil || !strings.Contains(out.String(), "dead-letters") {
			t.Errorf("outbox -h: %v\n%s", err, out.String())
		}
	})
}
