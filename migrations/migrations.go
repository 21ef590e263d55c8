// Package migrations holds the SQL of every service schema and applies it with
// goose.
//
// Each service owns one Postgres schema and keeps its own goose version table
// inside it, so services migrate independently and a schema can move to its
// own database later. Version 1 of every schema is eventing.sql (the outbox,
// inbox and dead-letter tables, one definition shared by all services), and
// later shared versions count from 1000002 (eventing_inbox.sql);
// migrations/<service>/*.sql hold the service's own tables from version 2 on.
//
// Apply is idempotent and safe to run from several processes at once: goose
// takes a Postgres advisory lock per schema for the duration. Run by a role
// that may not create in an existing schema (a service's least-privilege
// role, see `shop migrate -roles`), it only checks that nothing is pending.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed eventing.sql
var eventingSQL string

// The eventing tables' later versions. They are numbered from
// eventingLater on, far above any service's own migrations (which count
// from 2), so that the two sequences never collide; goose is told not to
// mind the interleaving (WithAllowOutofOrder), since they touch different
// tables. Add one here, never edit an applied one.
const eventingLater = 1_000_000

//go:embed eventing_inbox.sql
var eventingInboxSQL string

//go:embed order inventory payment fulfillment
var serviceFS embed.FS

// Schemas maps each service to the schema it owns, as the contract names them.
var Schemas = map[string]string{
	"order":       "orders",
	"inventory":   "inventory",
	"payment":     "payment",
	"fulfillment": "fulfillment",
}

// Services lists the services in start-up order.
var Services = []string{"inventory", "order", "payment", "fulfillment"}

// Apply creates schema if needed and brings it up to the latest version: the
// eventing tables, then the migrations of service ("" for the eventing tables
// alone, which is what the library tests use).
func Apply(ctx context.Context, connString, service, schema string, log *slog.Logger) error {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return fmt.Errorf("parse database url: %w", err)
	}
	cfg.RuntimeParams["search_path"] = schema
	db := stdlib.OpenDB(*cfg)
	defer db.Close()

	// A service running with its own least-privilege role (shop migrate
	// -roles) may not create anything: the owner migrates. Such a role only
	// checks that nothing is pending, and stops the start-up if something is.
	var exists, mayCreate bool
	err = db.QueryRowContext(ctx, `SELECT n.oid IS NOT NULL, COALESCE(has_schema_privilege(n.oid, 'CREATE'), false)
		FROM (SELECT 1) AS one LEFT JOIN pg_namespace n ON n.nspname = $1`, schema).Scan(&exists, &mayCreate)
	if err != nil {
		return fmt.Errorf("inspect schema %s: %w", schema, err)
	}
	readOnly := exists && !mayCreate

	if !readOnly {
		// IF NOT EXISTS does not cover two creators in flight at once: the
		// loser fails on pg_namespace's unique index, and the schema exists.
		_, err = db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize())
		var pgErr *pgconn.PgError
		if err != nil && !(errors.As(err, &pgErr) && pgErr.Code == "23505") { // unique_violation
			return fmt.Errorf("create schema %s: %w", schema, err)
		}
	}

	var migrationFS fs.FS = emptyFS{}
	if service != "" {
		if _, ok := Schemas[service]; !ok {
			return fmt.Errorf("unknown service %q", service)
		}
		sub, err := ServiceMigrations(service)
		if err != nil {
			return err
		}
		migrationFS = sub
	}

	// One advisory lock per schema: copies of one service starting together
	// wait for each other; different schemas migrate in parallel.
	h := fnv.New64a()
	h.Write([]byte("shop.migrate." + schema))
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(int64(h.Sum64() >> 1)))
	if err != nil {
		return fmt.Errorf("migration lock: %w", err)
	}
	eventing := func(version int64, ddl string) *goose.Migration {
		return goose.NewGoMigration(version, &goose.GoFunc{RunTx: func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, ddl)
			return err
		}}, nil)
	}
	opts := []goose.ProviderOption{
		goose.WithGoMigrations(eventing(1, eventingSQL), eventing(eventingLater+2, eventingInboxSQL)),
		goose.WithAllowOutofOrder(true),
		goose.WithDisableGlobalRegistry(true),
		goose.WithSessionLocker(locker),
	}
	if log != nil {
		opts = append(opts, goose.WithSlog(log.With("schema", schema)))
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, migrationFS, opts...)
	if err != nil {
		return fmt.Errorf("goose provider for %s: %w", schema, err)
	}
	if readOnly {
		pending, err := p.HasPending(ctx)
		if err != nil {
			return fmt.Errorf("check migrations of %s: %w", schema, err)
		}
		if pending {
			return fmt.Errorf("schema %s has pending migrations and this role may not create in it: run `shop migrate` with the owner's DATABASE_URL first", schema)
		}
		if log != nil {
			log.Info("schema is current; not its owner, so not migrating", "schema", schema)
		}
		return nil
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrate %s: %w", schema, err)
	}
	return nil
}

// ServiceMigrations is service's own migration directory. A service whose
// directory is not embedded is an error, not an empty directory: otherwise
// `shop migrate <service>` would report success having created only the
// eventing tables, and the missing tables would surface later as dead
// letters.
func ServiceMigrations(service string) (fs.FS, error) {
	sub, err := fs.Sub(serviceFS, service)
	if err != nil {
		return nil, fmt.Errorf("migrations of %s: %w", service, err)
	}
	files, err := fs.Glob(sub, "*.sql")
	if err != nil {
		return nil, fmt.Errorf("migrations of %s: %w", service, err)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no migrations embedded for service %q: add migrations/%s/ to the //go:embed line in migrations/migrations.go", service, service)
	}
	return sub, nil
}

// emptyFS is the migration directory of the eventing-only schema.
type emptyFS struct{}

func (emptyFS) Open(name string) (fs.File, error) {
	return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
}
