// Package database holds the Postgres plumbing shared by the services and the
// tests: creating the database when it is missing and opening a pool bound to
// one service's schema.
package database

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// EnsureExists creates the database named in connString when it does not
// exist. Several processes may call it at once.
func EnsureExists(ctx context.Context, connString string) error {
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
		return fmt.Errorf("connect to database: %w", err)
	}
	name := cfg.Database
	cfg.Database = "postgres"
	conn, err = pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("connect to create database %s: %w", name, err)
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	// Another process won the race: duplicate_database when its CREATE had
	// committed before ours began, or a unique violation on pg_database
	// when both were in flight at once.
	if errors.As(err, &pgErr) && (pgErr.Code == "42P04" || pgErr.Code == "23505") {
		return nil
	}
	if err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// WithSchema returns connString with search_path set to schema, so that every
// connection made from it reads and writes that schema's tables unqualified.
func WithSchema(connString, schema string) (string, error) {
	u, err := url.Parse(connString)
	if err != nil || u.Scheme == "" {
		return "", fmt.Errorf("database url must be a postgres:// URL: %q", connString)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// NewPool opens a pool whose connections use schema.
func NewPool(ctx context.Context, connString, schema string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	// Named, so that pg_stat_activity shows which service holds how many
	// connections (the budget in docs/operations.md is measured so).
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = "shop " + schema
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open pool for %s: %w", schema, err)
	}
	return pool, nil
}
