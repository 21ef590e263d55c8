package migrations_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/proof/pgtest"
)

// A schema migrated before the libraries shipped their own DDL has their
// tables, recorded as versions of the service's own version table (1 and
// 1000002 for the eventing tables, 2 and 5 for the saga's in the order
// schema), and no library version tables. Applying the new layout to it
// must succeed, keep every row, and record the libraries' versions in their
// own tables; applying it again must change nothing.
func TestApplyUpgradesTheEarlierLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.New(t, migrations.Saga(), migrations.Service("order"))
	schema := pgx.Identifier{s.Name}.Sanitize()
	mustExec := func(sql string, args ...any) {
		t.Helper()
		if _, err := s.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// What the earlier layout left: no library version tables, their
	// versions in the service's table, and data in the libraries' tables.
	for _, lib := range []string{"outbox", "inbox", "saga"} {
		mustExec(`DROP TABLE ` + schema + `.` + lib + `_goose_version`)
	}
	for _, v := range []int64{1, 2, 5, 1_000_002} {
		mustExec(`INSERT INTO `+schema+`.goose_db_version (version_id, is_applied) VALUES ($1, true)`, v)
	}
	mustExec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version, subject, payload)
		VALUES (gen_random_uuid(), 'order', 'o-1', 1, 'OrderCreated', 1, 'orders.o-1.OrderCreated', '{}')`)
	mustExec(`INSERT INTO processed_events (consumer_name, event_id) VALUES ('c', gen_random_uuid())`)
	mustExec(`INSERT INTO saga_instances (id, type, state) VALUES ('o-1', 'order', 'PENDING')`)

	for range 2 { // the upgrade, then a no-op
		if err := migrations.Apply(ctx, pgtest.URL(), s.Name, []migrations.Set{migrations.Saga(), migrations.Service("order")}, nil); err != nil {
			t.Fatalf("apply to the earlier layout: %v", err)
		}
	}
	for table, want := range map[string]int{"outbox": 1, "processed_events": 1, "saga_instances": 1} {
		var n int
		if err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil || n != want {
			t.Errorf("%s: %d rows (%v), want %d: the upgrade must keep them", table, n, err, want)
		}
	}
	for lib, want := range map[string]int64{"outbox": 4, "inbox": 2, "saga": 2} {
		var v int64
		err := s.Pool.QueryRow(ctx, `SELECT max(version_id) FROM `+schema+`.`+lib+`_goose_version`).Scan(&v)
		if err != nil || v != want {
			t.Errorf("%s_goose_version: version %d (%v), want %d", lib, v, err, want)
		}
	}
	// The later columns of the earlier layout are there once, not twice.
	var cols int
	err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.columns
		WHERE table_schema = $1 AND table_name = 'saga_timeouts' AND column_name = 'trace_headers'`, s.Name).Scan(&cols)
	if err != nil || cols != 1 {
		t.Errorf("saga_timeouts.trace_headers: %d columns (%v), want 1", cols, err)
	}
}
