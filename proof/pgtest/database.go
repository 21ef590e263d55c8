package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shop-ref/shop/internal/database"
)

// Database is a throwaway database on the test server, for code that uses
// the services' fixed schema names (a whole shop) and so cannot share the
// test database with other tests.
type Database struct {
	Name string
	URL  string // URL() with the database name replaced
}

// CreateDatabase creates a database called prefix plus a random suffix on
// the test server. The caller drops it with Drop.
func CreateDatabase(ctx context.Context, prefix string) (Database, error) {
	var b [4]byte
	_, _ = rand.Read(b[:])
	d := Database{Name: prefix + hex.EncodeToString(b[:])}
	var err error
	if d.URL, err = withDatabase(d.Name); err != nil {
		return Database{}, err
	}
	if err := database.EnsureExists(ctx, d.URL); err != nil {
		return Database{}, fmt.Errorf("create database %s (set TEST_DATABASE_URL to use another server): %w", d.Name, err)
	}
	return d, nil
}

// NewDatabase is CreateDatabase for a test: the database is dropped when
// the test ends, after the cleanups registered later (the processes using
// it) have run.
func NewDatabase(tb testing.TB, prefix string) Database {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d, err := CreateDatabase(ctx, prefix)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.Drop(ctx); err != nil {
			tb.Error(err)
		}
	})
	return d
}

// Drop drops the database, closing the connections still open to it (a
// killed process's pool may hold some). It connects to the server's
// "postgres" database, which always exists: the test database may not,
// when only whole-shop tests ran.
func (d Database) Drop(ctx context.Context) error {
	maint, err := withDatabase("postgres")
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, maint)
	if err != nil {
		return fmt.Errorf("drop database %s: %w", d.Name, err)
	}
	defer conn.Close(ctx)
	return dropDatabase(ctx, conn, d.Name)
}

// DropDatabase drops database name over conn (a connection to another
// database), its replication slots first: a relay in cdc mode
// (RELAY_MODE=cdc) leaves a slot per service, which keeps WAL for good and
// makes DROP DATABASE fail ("database is used by an active logical
// replication slot") until it is gone. The walsenders of a stopped shop may
// not have exited yet, so they are terminated, and the drop retried.
func DropDatabase(ctx context.Context, conn *pgx.Conn, name string) error {
	return dropDatabase(ctx, conn, name)
}

func dropDatabase(ctx context.Context, conn *pgx.Conn, name string) error {
	var err error
	for try := 0; try < 50; try++ {
		if _, err = conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
			WHERE database = $1 AND active_pid IS NOT NULL`, name); err != nil {
			break
		}
		if _, err = conn.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
			WHERE database = $1`, name); err == nil {
			break
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "55006" { // object_in_use: its walsender is still exiting
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	if err != nil {
		return fmt.Errorf("drop the replication slots of database %s: %w", name, err)
	}
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// withDatabase returns URL() naming database name instead.
func withDatabase(name string) (string, error) {
	u, err := url.Parse(URL())
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", fmt.Errorf("the test database (TEST_DATABASE_URL, DATABASE_URL) must be given as a postgres:// URL")
	}
	u.Path = "/" + name
	return u.String(), nil
}
