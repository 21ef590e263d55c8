// Package testenv runs the libraries' tests against a real Postgres and a
// real NATS server, and nothing of the application around them: a schema
// per test holding only a library's own tables (applied from its
// migrations/ with goose, as an application would), and a NATS server with
// JetStream inside the test process.
//
// pkg/outbox, pkg/inbox and pkg/saga share it. It imports nothing of the
// shop, so a library copied alone into another module takes it along as
// its own internal/testenv: scripts/lift-check.sh does exactly that and
// runs the copy's tests.
//
// The database comes from TEST_DATABASE_URL, else DATABASE_URL, else
// DefaultURL; the database named there is created if it is missing.
package testenv

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
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

// Migrations is one line of goose migrations with its own version table: a
// library's migrations.FS() and, say, "outbox_goose_version".
type Migrations struct {
	Table string
	FS    fs.FS
}

// Schema is one test's schema.
type Schema struct {
	Name string
	// URL connects with search_path set to the schema.
	URL  string
	Pool *pgxpool.Pool
}

var (
	ensureOnce sync.Once
	ensureErr  error
)

// New creates a schema, applies sets to it in order, returns a pool of ten
// connections whose search_path is the schema, and drops the schema when
// the test ends. It returns after the migration's own session has ended, so
// that the statistics the migration caused are counted before the test
// first reads pg_stat_user_tables.
func New(t testing.TB, sets ...Migrations) *Schema {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := Open(ctx, sets...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// Open is New for code that has no testing.TB (a runnable example): the
// caller drops the schema with Close.
func Open(ctx context.Context, sets ...Migrations) (*Schema, error) {
	ensureOnce.Do(func() { ensureErr = ensureDatabase(ctx, URL()) })
	if ensureErr != nil {
		return nil, fmt.Errorf("test database (set TEST_DATABASE_URL to use another): %w", ensureErr)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	url, err := withParams(URL(), map[string]string{"search_path": name})
	if err != nil {
		return nil, err
	}
	migrator := "testenv-migrate-" + name
	err = retry(ctx, func(ctx context.Context) error { return migrate(ctx, name, migrator, sets) })
	s := &Schema{Name: name, URL: url}
	if err == nil {
		s.Pool, err = s.open(ctx, 10, "testenv "+name)
	}
	if err == nil {
		err = s.waitSessionsEnded(ctx, migrator)
	}
	if err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("migrate %s: %w", name, err)
	}
	return s, nil
}

// Close closes the schema's pool and drops the schema.
func (s *Schema) Close() error {
	if s.Pool != nil {
		s.Pool.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := retry(ctx, func(ctx context.Context) error {
		conn, err := pgx.Connect(ctx, URL())
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		// One drop at a time: a drop whose outbox is in a publication, and
		// another test's sweep of the publications left without tables,
		// would race (the drop fails: "publication does not exist").
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", dropLock); err != nil {
			return err
		}
		if _, err = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{s.Name}.Sanitize()+" CASCADE"); err != nil {
			return err
		}
		return dropOrphanSlots(ctx, conn) // the lock ends with the connection
	})
	if err != nil {
		return fmt.Errorf("drop schema %s: %w", s.Name, err)
	}
	return nil
}

// dropLock is the advisory lock that serializes the tests' schema drops.
const dropLock = 0x7e57_d409

// dropOrphanSlots drops the replication slots, and their publications, of
// outboxes whose tables are gone (this test's, or a killed test's): a slot
// left behind would keep the server's WAL for ever. An outbox relay in
// ModeCDC names both outbox_<database>_<schema>; the publication loses
// its table when the schema is dropped.
func dropOrphanSlots(ctx context.Context, conn *pgx.Conn) error {
	rows, err := conn.Query(ctx, `
		SELECT s.slot_name FROM pg_replication_slots s
		WHERE s.database = current_database() AND s.slot_type = 'logical' AND s.slot_name LIKE 'outbox\_%'
		  AND NOT EXISTS (SELECT 1 FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid
		                  WHERE p.pubname = s.slot_name)`)
	// The catalogs, not pg_publication_tables: the view calls a function
	// per publication that fails on one dropped meanwhile. And best effort
	// all through: a sweep that fails is done by the next test's.
	if err != nil {
		return nil
	}
	slots, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil
	}
	for _, slot := range slots {
		_, _ = conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL`, slot)
		for try := 0; ; try++ {
			_, err := conn.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot)
			if err == nil || try == 50 {
				break
			}
			time.Sleep(20 * time.Millisecond) // the terminated walsender is still going
		}
		// Best effort: another test's cleanup may sweep the same orphan
		// at the same moment, and lose the race to drop it.
		_, _ = conn.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{slot}.Sanitize())
	}
	return nil
}

func migrate(ctx context.Context, schema, app string, sets []Migrations) error {
	cfg, err := pgx.ParseConfig(URL())
	if err != nil {
		return fmt.Errorf("parse database url: %w", err)
	}
	cfg.RuntimeParams["search_path"] = schema
	cfg.RuntimeParams["application_name"] = app
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return err
	}
	for _, m := range sets {
		if err := up(ctx, db, m); err != nil {
			return err
		}
	}
	return nil
}

func up(ctx context.Context, db *sql.DB, m Migrations) error {
	p, err := goose.NewProvider(goose.DialectPostgres, db, m.FS,
		goose.WithTableName(m.Table), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return err
	}
	_, err = p.Up(ctx)
	return err
}

// NewPool opens another pool on the schema (another "process"), closed when
// the test ends.
func (s *Schema) NewPool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return s.NewAppPool(t, maxConns, "testenv "+s.Name)
}

// NewAppPool is NewPool with sessions named app (application_name), so that
// WaitSessionsEnded can tell when they are all gone.
func (s *Schema) NewAppPool(t testing.TB, maxConns int32, app string) *pgxpool.Pool {
	t.Helper()
	pool, err := s.open(context.Background(), maxConns, app)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func (s *Schema) open(ctx context.Context, maxConns int32, app string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = s.Name
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	cfg.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, cfg)
}

// Postgres's cumulative statistics (pg_stat_user_tables) reach the shared
// counters late: a session flushes what it counted at most once a second
// while it works, and when it goes idle or ends. A test that compares
// counters before and after some work settles the sessions that ran before
// it (FlushStats) and waits for the work's own sessions to end
// (WaitSessionsEnded).

// FlushStats makes every idle session of the schema's pool flush the
// statistics it has not reported yet; it returns once they are counted.
func (s *Schema) FlushStats(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	for _, c := range s.Pool.AcquireAllIdle(ctx) {
		// The flush happens as the session goes idle after this statement.
		_, err := c.Exec(ctx, "SELECT pg_stat_force_next_flush()")
		c.Release()
		if err != nil {
			t.Fatalf("flush statistics: %v", err)
		}
	}
	if _, err := s.Pool.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
}

// WaitSessionsEnded waits until no session named app is connected: a
// session leaves pg_stat_activity only after it has flushed its statistics.
func (s *Schema) WaitSessionsEnded(t testing.TB, app string) {
	t.Helper()
	if err := s.waitSessionsEnded(context.Background(), app); err != nil {
		t.Fatal(err)
	}
}

func (s *Schema) waitSessionsEnded(ctx context.Context, app string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		var n int
		err := s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n)
		if err != nil {
			return fmt.Errorf("wait for the sessions of %s to end: %w", app, err)
		}
		if n == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d sessions of %s still connected after 30s", n, app)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Dump runs queries on the schema and returns their rows as text, one line
// per row, for a test that compares what two schemas hold. The queries
// should order their rows and leave out what differs by nature (times,
// generated ids).
func (s *Schema) Dump(t testing.TB, queries ...string) string {
	t.Helper()
	var out strings.Builder
	for _, q := range queries {
		rows, err := s.Pool.Query(context.Background(), q)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				t.Fatalf("%s: %v", q, err)
			}
			fmt.Fprintln(&out, vals...)
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	return out.String()
}

// ensureDatabase creates the database connString names when it is missing.
func ensureDatabase(ctx context.Context, connString string) error {
	return retry(ctx, func(ctx context.Context) error {
		cfg, err := pgx.ParseConfig(connString)
		if err != nil {
			return fmt.Errorf("parse database url: %w", err)
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err == nil {
			return conn.Close(ctx)
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "3D000" { // invalid_catalog_name
			return err
		}
		name := cfg.Database
		cfg.Database = "postgres"
		if conn, err = pgx.ConnectConfig(ctx, cfg); err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
		// Another test process won the race.
		if errors.As(err, &pgErr) && (pgErr.Code == "42P04" || pgErr.Code == "23505") {
			return nil
		}
		return err
	})
}

// retry calls fn until it succeeds, fails for a reason other than a busy or
// restarting server, or ctx ends. Postgres's connections are shared by
// every test process on the machine: "too many clients" is a wait, not a
// failed test.
func retry(ctx context.Context, fn func(context.Context) error) error {
	for {
		err := fn(ctx)
		if err == nil || !transient(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func transient(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "53300" || pgErr.Code == "57P03" || pgErr.Code == "57P01" ||
			pgErr.Code == "53000" || strings.HasPrefix(pgErr.Code, "08")
	}
	var netErr net.Error
	var connErr *pgconn.ConnectError
	return errors.As(err, &netErr) || errors.As(err, &connErr) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, pgconn.ErrConnClosed)
}

// withParams returns the postgres:// URL connString with params set.
func withParams(connString string, params map[string]string) (string, error) {
	u, err := url.Parse(connString)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", fmt.Errorf("the test database (TEST_DATABASE_URL, DATABASE_URL) must be a postgres:// URL")
	}
	q := u.Query()
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String(), nil
}
