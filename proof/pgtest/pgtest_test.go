package pgtest_test

import (
	"context"
	"testing"

	"github.com/shop-ref/shop/proof/pgtest"
)

func TestNewMigratesAnIsolatedSchema(t *testing.T) {
	t.Parallel()
	a := pgtest.New(t)
	b := pgtest.New(t)
	if a.Name == b.Name {
		t.Fatalf("two tests share schema %s", a.Name)
	}
	ctx := context.Background()
	var schema string
	if err := a.Pool.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		t.Fatal(err)
	}
	if schema != a.Name {
		t.Fatalf("pool uses schema %q, want %q", schema, a.Name)
	}
	for _, table := range []string{"outbox", "outbox_sequences", "processed_events", "inbox_sequences", "dead_letters"} {
		var n int
		if err := a.Pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatalf("table %s: %v", table, err)
		}
	}
}
