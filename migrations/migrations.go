// Package migrations applies the SQL of every service schema with goose.
//
// Each service owns one Postgres schema, so services migrate independently
// and a schema can move to its own database later. A schema holds several
// lines of migrations (Sets), each with a goose version table of its own, so
// that one line's versions never interleave with another's:
//
//   - the libraries' tables, shipped by the libraries themselves: pkg/outbox
//     and pkg/inbox in every schema (Eventing), pkg/saga in the schema of a
//     service that runs a saga (Saga);
//   - the service's own tables: migrations/<service>/*.sql (Service), in
//     goose's default version table.
//
// The libraries' sets are applied first, so a service's tables may refer to
// theirs. Schemas migrated before the libraries carried their own DDL have
// the libraries' tables recorded as versions 1 and 1000002 of the service's
// version table; the libraries' statements are idempotent, so their own
// version tables simply record them again.
//
// Apply is idempotent and safe to run from several processes at once: goose
// takes a Postgres advisory lock per schema while it applies a set, and every
// process applies the sets in the same order. Run by a role that may not
// create in an existing schema (a service's least-privilege role, see `shop
// migrate -roles`), it only checks that nothing is pending.
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

	inboxsql "github.com/shop-ref/shop/pkg/inbox/migrations"
	outboxsql "github.com/shop-ref/shop/pkg/outbox/migrations"
	sagasql "github.com/shop-ref/shop/pkg/saga/migrations"
)

// Every directory's SQL, so that a new service's migrations/<name>/ needs no
// edit here.
//
//go:embed */*.sql
var serviceFS embed.FS

// Set is one line of goose migrations with a version table of its own.
type Set struct {
	Name  string // what it creates, for logs and errors: "outbox", "saga", "order"
	Table string // goose's version table in the schema
	FS    fs.FS  // the goose SQL files
	err   error  // why the set cannot be applied (see Service)
}

// Outbox is pkg/outbox's set: the outbox, its sequence counters and the
// relays' heartbeats.
func Outbox() Set { return Set{Name: "outbox", Table: "outbox_goose_version", FS: outboxsql.FS()} }

// Inbox is pkg/inbox's set: processed events, cursors, failures, dead
// letters and parked events.
func Inbox() Set { return Set{Name: "inbox", Table: "inbox_goose_version", FS: inboxsql.FS()} }

// Saga is pkg/saga's set: instances, durable timeouts and unexpected
// events, for the schema of a service that runs a saga.
func Saga() Set { return Set{Name: "saga", Table: "saga_goose_version", FS: sagasql.FS()} }

// Eventing are the sets every service schema carries, applied before any
// other: the outbox's tables and the inbox's.
func Eventing() []Set { return []Set{Outbox(), Inbox()} }

// Service is the set of service's own migrations, migrations/<service>/*.sql,
// numbered from 00002 (version 1 was the eventing tables before they moved
// to the libraries). A service whose directory holds no SQL is not an empty
// set that migrates "successfully", having created only the eventing
// tables, with the missing tables surfacing later as dead letters: Apply
// fails on it, saying what to add.
func Service(service string) Set {
	sub, err := fs.Sub(serviceFS, service)
	if err != nil {
		return Set{Name: service, Table: goose.DefaultTablename, err: err}
	}
	return Own(service, sub)
}

// Own is the set of service's own migrations in fsys, kept where Service
// keeps them (goose's default version table); no SQL in fsys is the same
// error as Service's.
func Own(service string, fsys fs.FS) Set {
	set := Set{Name: service, Table: goose.DefaultTablename, FS: fsys}
	files, err := fs.Glob(fsys, "*.sql")
	if err == nil && len(files) == 0 {
		err = fmt.Errorf("no migrations for service %q: add its tables as goose SQL files migrations/%s/00002_<name>.sql", service, service)
	}
	set.err = err
	return set
}

// Err reports why the set cannot be applied, nil when it can.
func (s Set) Err() error { return s.err }

// Apply creates schema if needed and brings it up to date: the Eventing
// sets, then sets in order.
func Apply(ctx context.Context, connString, schema string, sets []Set, log *slog.Logger) error {
	all := append(Eventing(), sets...)
	for _, s := range all {
		if s.err != nil {
			return s.err
		}
	}
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

	// One advisory lock per schema, whichever set: copies of one service
	// starting together wait for each other; different schemas migrate in
	// parallel.
	h := fnv.New64a()
	h.Write([]byte("shop.migrate." + schema))
	lockID := int64(h.Sum64() >> 1)
	for _, s := range all {
		if err := apply(ctx, db, schema, s, lockID, readOnly, log); err != nil {
			return err
		}
	}
	if readOnly && log != nil {
		log.Info("schema is current; not its owner, so not migrating", "schema", schema)
	}
	return nil
}

// apply brings one set up to date, or with readOnly checks that it is.
func apply(ctx context.Context, db *sql.DB, schema string, s Set, lockID int64, readOnly bool, log *slog.Logger) error {
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(lockID))
	if err != nil {
		return fmt.Errorf("migration lock: %w", err)
	}
	opts := []goose.ProviderOption{
		goose.WithTableName(s.Table),
		goose.WithDisableGlobalRegistry(true),
		goose.WithSessionLocker(locker),
	}
	if s.Table == goose.DefaultTablename {
		// A service's own version table: in schemas migrated before the
		// libraries had version tables of their own, it also records the
		// eventing tables as versions 1 and 1000002, above which the
		// service's later files would count as "missing".
		opts = append(opts, goose.WithAllowOutofOrder(true))
	}
	if log != nil {
		opts = append(opts, goose.WithSlog(log.With("schema", schema, "migrations", s.Name)))
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, s.FS, opts...)
	if err != nil {
		return fmt.Errorf("goose provider for %s in %s: %w", s.Name, schema, err)
	}
	if readOnly {
		pending, err := p.HasPending(ctx)
		if err != nil {
			return fmt.Errorf("check migrations of %s in %s: %w", s.Name, schema, err)
		}
		if pending {
			return fmt.Errorf("schema %s has pending migrations (%s) and this role may not create in it: run `shop migrate` with the owner's DATABASE_URL first", schema, s.Name)
		}
		return nil
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrate %s in %s: %w", s.Name, schema, err)
	}
	return nil
}
