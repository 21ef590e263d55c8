package app

import (
	"context"
	"crypto/hmac"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/config"
)

// Least privilege: `shop migrate -roles` gives each service a login role of
// its own that can use its own schema and nothing else. The owner (the admin
// DATABASE_URL that ran the migrations) keeps creating and altering tables;
// a service started with its role in <SERVICE>_DATABASE_URL only reads and
// writes rows (migrations.Apply then checks that nothing is pending instead
// of migrating).

// SharedRolePasswordEnv names the password of every service role that has no
// <SERVICE>_ROLE_PASSWORD of its own: convenient for a demo, one secret per
// service for anything else.
const SharedRolePasswordEnv = "SHOP_ROLE_PASSWORD"

// RoleName is the database role of service: shop_order, shop_inventory, …
func RoleName(service string) string { return "shop_" + service }

// RolePasswordEnv is the environment variable that holds the password of
// service's role: ORDER_ROLE_PASSWORD, INVENTORY_ROLE_PASSWORD, …
func RolePasswordEnv(service string) string { return strings.ToUpper(service) + "_ROLE_PASSWORD" }

// RolePassword reads the password of service's role from getenv:
// <SERVICE>_ROLE_PASSWORD, else SHOP_ROLE_PASSWORD. Passwords are printable
// ASCII (so that every client hashes them alike) of 8 characters or more.
// The error names the variables, never the value.
func RolePassword(getenv func(string) string, service string) (string, error) {
	env := RolePasswordEnv(service)
	pw, from := getenv(env), env
	if pw == "" {
		pw, from = getenv(SharedRolePasswordEnv), SharedRolePasswordEnv
	}
	switch {
	case pw == "":
		return "", fmt.Errorf("role %s: set %s (or %s for every service) to its password", RoleName(service), env, SharedRolePasswordEnv)
	case len(pw) < 8:
		return "", fmt.Errorf("role %s: the password in %s is shorter than 8 characters", RoleName(service), from)
	}
	for _, c := range []byte(pw) {
		if c < 0x21 || c > 0x7e {
			return "", fmt.Errorf("role %s: the password in %s must be printable ASCII without spaces", RoleName(service), from)
		}
	}
	return pw, nil
}

// CreateRole makes role a login role with password that may use service's
// schema, and only it, in the service's database (schemas.DatabaseURLOf,
// connected as the schema's owner, after the migrations). It is idempotent: a second run sets
// the password again (a rotation) and re-grants, which also covers tables
// created since by another owner. What it grants:
//
//   - CONNECT and TEMPORARY on the database;
//   - USAGE (not CREATE) on its schema; SELECT, INSERT, UPDATE, DELETE on
//     its tables (only SELECT on the goose version tables, its own and its
//     libraries') and USAGE, SELECT
//     on its sequences;
//   - the same on tables and sequences the owner creates later in the schema
//     (ALTER DEFAULT PRIVILEGES), so the next migration needs no re-run;
//
// and it revokes whatever the role holds on the other services' schemas, and
// CREATE on schema public from PUBLIC (the default before PostgreSQL 15).
// The password travels as a SCRAM-SHA-256 verifier computed here, so neither
// the statement nor a server log holds it in clear.
func CreateRole(ctx context.Context, schemas config.Schemas, service, role, password string, log *slog.Logger) error {
	e, err := schemas.Registry.Get(service)
	if err != nil {
		return err
	}
	databaseURL, schema := schemas.DatabaseURLOf(service), e.Schema
	if role == "" || password == "" {
		return fmt.Errorf("role of %s: a name and a password are needed", service)
	}
	verifier, err := scramVerifier(password)
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return fmt.Errorf("role %s: connect: %w", role, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))

	r := pgx.Identifier{role}.Sanitize()
	s := pgx.Identifier{schema}.Sanitize()
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		// Roles are cluster-wide: one lock for every shop migrate -roles,
		// so two of them do not race on CREATE ROLE.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('shop.migrate.roles'))`); err != nil {
			return err
		}
		var exists, tooMighty bool
		err := tx.QueryRow(ctx, `SELECT count(*) > 0, COALESCE(bool_or(rolsuper OR rolbypassrls OR rolcreaterole OR rolcreatedb OR rolreplication), false)
			FROM pg_roles WHERE rolname = $1`, role).Scan(&exists, &tooMighty)
		if err != nil {
			return err
		}
		if tooMighty {
			return fmt.Errorf("role %s exists with SUPERUSER, BYPASSRLS, CREATEROLE, CREATEDB or REPLICATION: refusing to use it as a least-privilege role", role)
		}
		if !exists {
			if _, err := tx.Exec(ctx, "CREATE ROLE "+r+" NOINHERIT"); err != nil {
				return fmt.Errorf("create role %s: %w", role, err)
			}
		}
		// The verifier holds base64 characters, '$' and ':' only: safe as
		// a literal (CREATE/ALTER ROLE take no parameters).
		if _, err := tx.Exec(ctx, "ALTER ROLE "+r+" WITH LOGIN PASSWORD '"+verifier+"'"); err != nil {
			return fmt.Errorf("alter role %s: %w", role, err)
		}

		var db string
		if err := tx.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
			return err
		}
		stmts := []string{
			"GRANT CONNECT, TEMPORARY ON DATABASE " + pgx.Identifier{db}.Sanitize() + " TO " + r,
			"REVOKE CREATE ON SCHEMA public FROM PUBLIC",

			"REVOKE ALL ON SCHEMA " + s + " FROM PUBLIC",
			"REVOKE CREATE ON SCHEMA " + s + " FROM " + r,
			"GRANT USAGE ON SCHEMA " + s + " TO " + r,
			"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA " + s + " TO " + r,
			"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA " + s + " TO " + r,
			"ALTER DEFAULT PRIVILEGES IN SCHEMA " + s + " GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO " + r,
			"ALTER DEFAULT PRIVILEGES IN SCHEMA " + s + " GRANT USAGE, SELECT ON SEQUENCES TO " + r,
		}
		// The version tables (the service's own and each library's) are the
		// owner's: the role may only read them, to see at start-up that
		// nothing is pending.
		rows, err := tx.Query(ctx, `SELECT tablename FROM pg_tables WHERE schemaname = $1
			AND (tablename = 'goose_db_version' OR tablename LIKE '%\_goose\_version')`, schema)
		if err != nil {
			return err
		}
		versionTables, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		for _, vt := range versionTables {
			stmts = append(stmts, "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON TABLE "+pgx.Identifier{schema, vt}.Sanitize()+" FROM "+r)
		}
		// Whatever the role may once have had on the other schemas goes.
		for _, other := range schemas.Registry {
			o := other.Schema
			if o == schema {
				continue
			}
			var present bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, o).Scan(&present); err != nil {
				return err
			}
			if !present {
				continue
			}
			os := pgx.Identifier{o}.Sanitize()
			stmts = append(stmts,
				"REVOKE ALL ON SCHEMA "+os+" FROM "+r,
				"REVOKE ALL ON ALL TABLES IN SCHEMA "+os+" FROM "+r,
				"REVOKE ALL ON ALL SEQUENCES IN SCHEMA "+os+" FROM "+r,
				"ALTER DEFAULT PRIVILEGES IN SCHEMA "+os+" REVOKE ALL ON TABLES FROM "+r,
				"ALTER DEFAULT PRIVILEGES IN SCHEMA "+os+" REVOKE ALL ON SEQUENCES FROM "+r,
			)
		}
		for _, q := range stmts {
			if _, err := tx.Exec(ctx, q); err != nil {
				return fmt.Errorf("%s: %w", q, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("role %s: %w", role, err)
	}
	if log != nil {
		log.Info("service role ready", "role", role, "schema", schema) // never the password
	}
	return nil
}

// scramVerifier returns the SCRAM-SHA-256 verifier PostgreSQL stores for
// password (RFC 5802, RFC 7677; the format of pg_authid.rolpassword).
// Passwords are printable ASCII (RolePassword), for which SASLprep changes
// nothing.
func scramVerifier(password string) (string, error) {
	const iterations = 4096
	salt := make([]byte, 16)
	if _, err := rand.Read(salt); err != nil {
		return "", err
	}
	salted, err := pbkdf2.Key(sha256.New, password, salt, iterations, sha256.Size)
	if err != nil {
		return "", err
	}
	mac := func(key []byte, msg string) []byte {
		h := hmac.New(sha256.New, key)
		h.Write([]byte(msg))
		return h.Sum(nil)
	}
	stored := sha256.Sum256(mac(salted, "Client Key"))
	server := mac(salted, "Server Key")
	b64 := base64.StdEncoding.EncodeToString
	v := fmt.Sprintf("SCRAM-SHA-256$%d:%s$%s:%s", iterations, b64(salt), b64(stored[:]), b64(server))
	if strings.ContainsAny(v, `'\`) {
		return "", errors.New("scram verifier: unexpected character") // cannot happen with base64
	}
	return v, nil
}
