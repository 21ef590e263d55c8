// Package pgtest gives each test its own freshly migrated Postgres schema, so
// tests run in parallel against the real database and leave nothing behind.
//
// The database comes from TEST_DATABASE_URL, else DATABASE_URL, else
// DefaultURL; the database named there is created if it is missing.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/outbox"
)

// DefaultURL is the database tests use when no environment variable names one.
const DefaultURL = "postgres://postgres:postgres@127.0.0.1:5432/shop_test?sslmode=disable"

// URL returns the connection string of the test database.
func URL() string {
	for _, k := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return DefaultURL
}

var (
	ensureOnce sync.Once
	ensureErr  error
)

// Schema is one test's schema.
type Schema struct {
	Name string
	// URL connects with search_path set to the schema.
	URL  string
	Pool *pgxpool.Pool
}

// New creates a schema holding the eventing tables (the outbox's and the
// inbox's) and those of the migration sets given (a service's:
// order.Registration.Sets()...; the saga's: migrations.Saga()), returns a
// pool whose connections use it, and drops the schema when the test ends. It returns after the
// migration's own session has ended, so the statistics it caused (building an
// index counts as a sequential scan of its table) are already counted when
// the test first reads pg_stat_user_tables.
func New(t testing.TB, sets ...migrations.Set) *Schema {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	ensureOnce.Do(func() { ensureErr = database.EnsureExists(ctx, URL()) })
	if ensureErr != nil {
		t.Fatalf("test database (set TEST_DATABASE_URL to use another): %v", ensureErr)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])

	// Postgres allows 100 connections, shared by every test process on the
	// machine: "too many clients" (or a server restarting) is a wait, as it
	// is for a service starting up, not a failed test.
	quiet := slog.New(slog.DiscardHandler)
	migrator := "pgtest-migrate-" + name
	err := database.Retry(ctx, quiet, "migrate", func(ctx context.Context) error {
		return migrations.Apply(ctx, withAppName(URL(), migrator), name, sets, nil)
	})
	if err != nil {
		t.Fatalf("migrate %s: %v", name, err)
	}
	url, err := database.WithSchema(URL(), name)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := database.NewPool(ctx, URL(), name, 10)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var conn *pgx.Conn
		err := database.Retry(ctx, quiet, "drop schema", func(ctx context.Context) (err error) {
			conn, err = pgx.Connect(ctx, URL())
			return err
		})
		if err != nil {
			t.Errorf("drop schema %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		// A relay in cdc mode made a replication slot for the schema's
		// outbox; left behind, it pins the cluster's WAL for ever (slots
		// outlive schemas), so it goes with the schema.
		var database string
		if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&database); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		} else if err := outbox.DropSlot(ctx, conn, outbox.SlotName(database, name)); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
	})
	if err := waitSessionsEnded(ctx, pool, migrator); err != nil {
		t.Fatal(err)
	}
	return &Schema{Name: name, URL: url, Pool: pool}
}

// NewPool opens another pool on the same schema (another "process"), closed
// when the test ends.
func (s *Schema) NewPool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	pool, err := database.NewPool(context.Background(), URL(), s.Name, maxConns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
