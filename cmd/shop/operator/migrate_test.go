package operator

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

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

// allSchemas are every service's schema, sorted.
var allSchemas = func() []string {
	var schemas []string
	for _, e := range services.All {
		schemas = append(schemas, e.Schema)
	}
	slices.Sort(schemas)
	return schemas
}()

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
		dbURL := shoptest.NewDatabaseURL(t)
		for i := range 2 {
			if err := run(ctx, []string{"migrate"}, env(map[string]string{"DATABASE_URL": dbURL}), io.Discard, io.Discard); err != nil {
				t.Fatalf("migrate, run %d: %v", i+1, err)
			}
		}
		checkSchemas(t, dbURL)
	})

	t.Run("two processes at once on a fresh database", func(t *testing.T) {
		t.Parallel()
		dbURL := shoptest.NewDatabaseURL(t)
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
		dbURL := shoptest.NewDatabaseURL(t)
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
