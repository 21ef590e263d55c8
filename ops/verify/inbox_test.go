package verify_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// An event parked for minutes waits for one that is not coming by itself,
// and a conflict is named as such; both are reported until an operator has
// discarded them (with a reason), after which they count no longer.
func TestParkedAndConflictsAreReportedUntilDiscarded(t *testing.T) {
	t.Parallel()
	pools := shoptest.Schemas(t, services.All)
	ctx := context.Background()
	db := pools.Pools["inventory"]
	stuck, fresh := uuid.New(), uuid.New()
	for _, p := range []struct {
		id  uuid.UUID
		age string
		seq int
	}{{stuck, "10 minutes", 5}, {fresh, "5 seconds", 6}} {
		if _, err := db.Exec(ctx, `INSERT INTO inbox_parked (consumer_name, source, aggregate_type, aggregate_id,
			aggregate_seq, event_id, stream, stream_seq, subject, headers, payload, parked_at)
			VALUES ('inventory-orders', 'orders', 'order', 'o-1', $1, $2, 'ORDERS', $1, 'orders.o-1.OrderPaid', '{}', '', now() - $3::interval)`,
			p.seq, p.id, p.age); err != nil {
			t.Fatal(err)
		}
	}
	var deadID int64
	if err := db.QueryRow(ctx, `INSERT INTO dead_letters (consumer_name, stream, stream_seq, subject, headers, payload,
		event_id, error, attempts, first_failed_at, last_failed_at, conflict_with)
		VALUES ('inventory-orders', 'ORDERS', 9, 'orders.o-2.OrderPaid', '{}', '', gen_random_uuid(), 'conflict', 1, now(), now(), gen_random_uuid())
		RETURNING id`).Scan(&deadID); err != nil {
		t.Fatal(err)
	}
	violations := func() map[string][]string {
		t.Helper()
		rep, err := verify.Run(ctx, pools, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		v := map[string][]string{}
		for _, c := range rep.Checks {
			v[c.Name] = c.Violations
		}
		return v
	}
	const parked, dead = "inventory: no event parked longer than 5m0s", "inventory: no dead letters"
	v := violations()
	if len(v[parked]) != 1 || !strings.Contains(v[parked][0], stuck.String()) {
		t.Errorf("%s: %q, want the event parked 10 minutes ago alone", parked, v[parked])
	}
	if len(v[dead]) != 1 || !strings.Contains(v[dead][0], "CONFLICT") {
		t.Errorf("%s: %q, want the conflict, named as such", dead, v[dead])
	}
	if err := inbox.DiscardParked(ctx, db, "inventory-orders", stuck, "its predecessor was forged"); err != nil {
		t.Fatal(err)
	}
	if err := inbox.DiscardDeadLetter(ctx, db, deadID, "the forged side of a conflict"); err != nil {
		t.Fatal(err)
	}
	v = violations()
	if len(v[parked]) != 0 || len(v[dead]) != 0 {
		t.Errorf("after the discards: %q %q, want none", v[parked], v[dead])
	}
}

// An event a consumer keeps failing on is named before the consumer gives
// up on it: more than three failed attempts are a violation, fewer are not.
func TestEventsRetriedOftenAreReported(t *testing.T) {
	t.Parallel()
	pools := shoptest.Schemas(t, services.All)
	ctx := context.Background()
	often, twice := uuid.New(), uuid.New()
	for id, attempts := range map[uuid.UUID]int{often: 4, twice: 2} {
		if _, err := pools.Pools["payment"].Exec(ctx, `INSERT INTO inbox_failures
			(consumer_name, event_id, attempts, first_failed_at, last_failed_at, last_error)
			VALUES ('payment-orders', $1, $2, now(), now(), 'the provider is down')`, id, attempts); err != nil {
			t.Fatal(err)
		}
	}
	rep, err := verify.Run(ctx, pools, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	const name = "payment: no event retried more than 3 times"
	for _, c := range rep.Checks {
		if c.Name == name {
			if len(c.Violations) != 1 || !strings.Contains(c.Violations[0], often.String()+" failed 4 times") {
				t.Errorf("%s: %q, want the event that failed 4 times alone", name, c.Violations)
			}
			return
		}
	}
	t.Fatalf("no check %q in %+v", name, rep.Checks)
}

// A service's replication slot that no relay has confirmed for minutes is
// reported; one just made is not, and a shop without slots has no such
// check.
func TestStaleSlotIsReported(t *testing.T) {
	t.Parallel()
	pools := shoptest.Schemas(t, services.All)
	ctx := context.Background()
	db := pools.Pools["payment"]
	names := func() map[string][]string {
		t.Helper()
		rep, err := verify.Run(ctx, pools, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		v := map[string][]string{}
		for _, c := range rep.Checks {
			if strings.Contains(c.Name, "replication slot") {
				v[c.Name] = c.Violations
			}
		}
		return v
	}
	if v := names(); len(v) != 0 {
		t.Fatalf("no slot: checks %q, want none", v)
	}
	var database, schema string
	if err := db.QueryRow(ctx, `SELECT current_database(), current_schema()`).Scan(&database, &schema); err != nil {
		t.Fatal(err)
	}
	slot := outbox.SlotName(database, schema)
	// Its publication first, as a relay makes them: a slot without one
	// (even while it is being made) is an orphan that other tests'
	// clean-up drops, terminating the backend that makes it.
	if _, err := db.Exec(ctx, "CREATE PUBLICATION "+pgx.Identifier{slot}.Sanitize()+" FOR TABLE "+
		pgx.Identifier{schema, "outbox"}.Sanitize()+" WITH (publish = 'insert')"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := outbox.DropSlot(context.Background(), db, slot); err != nil {
			t.Error(err)
		}
	})
	check := "payment: replication slot " + slot + " keeps its WAL and is confirmed within 1m0s"
	if v := names(); len(v) != 1 || len(v[check]) != 0 {
		t.Errorf("a slot just made: %q, want the check %q passing", v, check)
	}
	// What a relay's heartbeat last recorded, ten minutes ago: no relay
	// has streamed it since.
	if _, err := db.Exec(ctx, `INSERT INTO outbox_slots (slot, caught_up_at) VALUES ($1, now() - interval '10 minutes')`, slot); err != nil {
		t.Fatal(err)
	}
	if v := names(); len(v[check]) != 1 || !strings.Contains(v[check][0], "no relay streams it") {
		t.Errorf("a slot caught up 10 minutes ago: %q, want it reported", v)
	}
}
