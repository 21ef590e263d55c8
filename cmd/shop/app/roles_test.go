package app

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services"
	"github.com/shop-ref/shop/services/order"
)

func TestRolePassword(t *testing.T) {
	env := func(vars map[string]string) func(string) string { return func(k string) string { return vars[k] } }
	if pw, err := RolePassword(env(map[string]string{"ORDER_ROLE_PASSWORD": "order-secret", "SHOP_ROLE_PASSWORD": "shared-secret"}), "order"); err != nil || pw != "order-secret" {
		t.Errorf("own variable: %q, %v", pw, err)
	}
	if pw, err := RolePassword(env(map[string]string{"SHOP_ROLE_PASSWORD": "shared-secret"}), "payment"); err != nil || pw != "shared-secret" {
		t.Errorf("shared variable: %q, %v", pw, err)
	}
	for name, vars := range map[string]map[string]string{
		"none":      {},
		"short":     {"ORDER_ROLE_PASSWORD": "abc12"},
		"space":     {"ORDER_ROLE_PASSWORD": "with a space"},
		"non-ascii": {"ORDER_ROLE_PASSWORD": "pässwört-long"},
	} {
		_, err := RolePassword(env(vars), "order")
		if err == nil {
			t.Errorf("%s: no error", name)
			continue
		}
		if pw := vars["ORDER_ROLE_PASSWORD"]; pw != "" && strings.Contains(err.Error(), pw) {
			t.Errorf("%s: the error shows the password: %v", name, err)
		}
	}
}

// roleDatabase creates a database of its own (roles and default privileges
// are global or per database, so a schema of the shared test database will
// not do), migrated by the admin for every service; it is dropped, with the
// test's roles, when the test ends.
func roleDatabase(t *testing.T) (adminURL string, roles map[string]string) {
	t.Helper()
	u, err := url.Parse(pgtest.URL())
	if err != nil || u.Scheme == "" {
		t.Fatalf("test database URL must be a postgres:// URL: %v", err)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	suffix := hex.EncodeToString(b[:])
	name := "shop_roles_" + suffix
	admin := *u
	admin.Path = "/postgres"
	u.Path = "/" + name
	roles = map[string]string{}
	for _, s := range services.All.Names() {
		roles[s] = RoleName(s) + "_" + suffix // unique: tests share the cluster
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, admin.String())
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
		for _, r := range roles {
			if _, err := conn.Exec(ctx, "DROP ROLE IF EXISTS "+pgx.Identifier{r}.Sanitize()); err != nil {
				t.Errorf("drop role %s: %v", r, err)
			}
		}
	})
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	for _, e := range services.All {
		if err := Migrate(t.Context(), u.String(), e, log); err != nil {
			t.Fatal(err)
		}
	}
	return u.String(), roles
}

// roleURL is dbURL connecting as role with password, over TCP.
func roleURL(t *testing.T, dbURL, role, password string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, password)
	return u.String()
}

func wantDenied(t *testing.T, conn *pgx.Conn, q string) {
	t.Helper()
	_, err := conn.Exec(t.Context(), q)
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); !ok || pgErr.Code != "42501" {
		t.Errorf("%s: err %v, want permission denied (42501)", q, err)
	}
}

func wantAllowed(t *testing.T, conn *pgx.Conn, q string) {
	t.Helper()
	if _, err := conn.Exec(t.Context(), q); err != nil {
		t.Errorf("%s: %v", q, err)
	}
}

// TestServiceRoles creates the roles as `shop migrate -roles` does, then runs
// the order service (its real start-up, HTTP API and outbox relay) with its
// own role and shows that the role reaches its schema and nothing else.
func TestServiceRoles(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	dbURL, roles := roleDatabase(t)
	const password = "order-role-secret"
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	for range 2 { // idempotent: the second run re-grants and sets the password again
		cfg := adminConfig(t, dbURL)
		for _, s := range services.All.Names() {
			if err := CreateRole(ctx, cfg.Schemas(), s, roles[s], password+"-"+s, log); err != nil {
				t.Fatal(err)
			}
		}
	}

	admin, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	var stored string
	if err := admin.QueryRow(ctx, `SELECT rolpassword FROM pg_authid WHERE rolname = $1`, roles["order"]).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(stored, "SCRAM-SHA-256$4096:") || strings.Contains(stored, password) {
		t.Fatalf("stored password %q: want a SCRAM verifier", stored)
	}
	// A catalogue entry to order from (written by the admin, as the
	// order-inventory consumer would).
	if _, err := admin.Exec(ctx, `INSERT INTO orders.catalogue (sku, price, seq) VALUES ('SKU-1', 250, 1)`); err != nil {
		t.Fatal(err)
	}

	orderURL := roleURL(t, dbURL, roles["order"], password+"-order")
	conn, err := pgx.Connect(ctx, orderURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var user string
	if err := conn.QueryRow(ctx, `SELECT current_user`).Scan(&user); err != nil || user != roles["order"] {
		t.Fatalf("connected as %q (%v), want %s", user, err, roles["order"])
	}

	t.Run("own schema: rows yes, DDL no", func(t *testing.T) {
		rows, err := admin.Query(ctx, `SELECT tablename FROM pg_tables WHERE schemaname = 'orders'
			AND tablename <> 'goose_db_version' AND tablename NOT LIKE '%\_goose\_version'`)
		if err != nil {
			t.Fatal(err)
		}
		tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(tables) < 5 {
			t.Fatalf("tables of orders: %v %v", tables, err)
		}
		for _, tb := range tables {
			q := pgx.Identifier{"orders", tb}.Sanitize()
			wantAllowed(t, conn, "SELECT * FROM "+q+" LIMIT 1")
			wantAllowed(t, conn, "UPDATE "+q+" SET "+firstColumn(t, admin, tb)+" = "+firstColumn(t, admin, tb)+" WHERE false")
			wantAllowed(t, conn, "DELETE FROM "+q+" WHERE false")
		}
		wantAllowed(t, conn, `SELECT version_id FROM orders.goose_db_version LIMIT 1`)
		wantDenied(t, conn, `DELETE FROM orders.goose_db_version`)
		for _, lib := range []string{"outbox", "inbox", "saga"} { // each library's own version table
			wantAllowed(t, conn, `SELECT version_id FROM orders.`+lib+`_goose_version LIMIT 1`)
			wantDenied(t, conn, `DELETE FROM orders.`+lib+`_goose_version`)
		}
		wantDenied(t, conn, `CREATE TABLE orders.sneaky (id int)`)
		wantDenied(t, conn, `DROP TABLE orders.catalogue`)
		wantDenied(t, conn, `ALTER TABLE orders.catalogue ADD COLUMN x int`)
		wantDenied(t, conn, `TRUNCATE orders.catalogue`)
	})

	t.Run("other schemas: nothing", func(t *testing.T) {
		wantDenied(t, conn, `SELECT * FROM inventory.stock`)
		wantDenied(t, conn, `INSERT INTO inventory.stock (sku) VALUES ('SKU-X')`)
		wantDenied(t, conn, `UPDATE inventory.stock SET sku = sku`)
		wantDenied(t, conn, `CREATE TABLE inventory.sneaky (id int)`)
		wantDenied(t, conn, `SELECT * FROM inventory.outbox`)
		wantDenied(t, conn, `SELECT * FROM payment.outbox`)
		wantDenied(t, conn, `SELECT * FROM fulfillment.outbox`)
		wantDenied(t, conn, `CREATE TABLE public.sneaky (id int)`)
		wantDenied(t, conn, `CREATE SCHEMA sneaky`)
	})

	t.Run("tables of a later migration are covered", func(t *testing.T) {
		if _, err := admin.Exec(ctx, `CREATE TABLE orders.later (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text)`); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.Exec(ctx, `CREATE TABLE inventory.later (id int)`); err != nil {
			t.Fatal(err)
		}
		wantAllowed(t, conn, `INSERT INTO orders.later (note) VALUES ('x')`)
		wantAllowed(t, conn, `SELECT nextval(pg_get_serial_sequence('orders.later', 'id'))`)
		wantDenied(t, conn, `SELECT * FROM inventory.later`)
	})

	t.Run("the order service runs with its role", func(t *testing.T) {
		ns := natstest.New(t)
		nc, js := ns.Connect(t)
		// The streams, as the stream keeper of another process makes them.
		if err := ensureEveryStream(context.Background(), js, slog.New(slog.DiscardHandler)); err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadConfig(func(string) string { return "" })
		if err != nil {
			t.Fatal(err)
		}
		cfg.DatabaseURL = dbURL // the owner's; the order service must not use it
		cfg.Services["order"].DatabaseURL = orderURL
		cfg.Services["order"].Addr = freeAddr(t)
		// In cdc mode: a service role may not replicate nor own its outbox
		// table, so its relay cannot stream; it must poll, publish all the
		// same, and say why in its log and on /readyz.
		cfg.Services["order"].RelayMode = outbox.ModeCDC
		var logged logbuf.Buffer
		log := slog.New(slog.NewTextHandler(io.MultiWriter(&logged, t.Output()), &slog.HandlerOptions{Level: slog.LevelWarn}))
		svc, err := New("order", cfg, nc, log)
		if err != nil {
			t.Fatal(err)
		}
		runCtx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- svc.Run(runCtx) }() // migrations: only the "nothing pending" check
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("order service: %v", err)
			}
		})

		base := "http://" + cfg.Services["order"].Addr
		var res *http.Response
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			select {
			case err := <-done:
				t.Fatalf("order service stopped: %v", err)
			default:
			}
			req, _ := http.NewRequest(http.MethodPost, base+"/orders", strings.NewReader(`{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2}]}`))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "roles-test-1")
			res, err = http.DefaultClient.Do(req)
			if err == nil || time.Now().After(deadline) {
				break
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusCreated {
			t.Fatalf("POST /orders as %s: %d %s", roles["order"], res.StatusCode, body)
		}
		// The relay, running as the role too, publishes OrderCreated and
		// marks it.
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			var n int
			if err := admin.QueryRow(ctx, `SELECT count(*) FROM orders.outbox WHERE event_type = 'OrderCreated' AND published_at IS NOT NULL`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("OrderCreated was not published by the order service's relay")
			}
		}
		// Ready, and the relay line says it polls and why, naming the
		// privilege and the variable that chooses polling.
		var ready struct {
			Dependencies map[string]struct {
				Status, Mode, Error string
			}
		}
		code := 0
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			res, err := http.Get(base + "/readyz")
			if err != nil {
				t.Fatal(err)
			}
			code = res.StatusCode
			err = json.NewDecoder(res.Body).Decode(&ready)
			res.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(ready.Dependencies["relay"].Error, "cdc unavailable") || time.Now().After(deadline) {
				break
			}
		}
		relay := ready.Dependencies["relay"]
		if code != http.StatusOK || relay.Mode != "cdc" || relay.Status != "polling" || !strings.Contains(relay.Error, "ORDER_RELAY_MODE=poll") ||
			!(strings.Contains(relay.Error, "REPLICATION") || strings.Contains(relay.Error, "ownership of the table")) {
			t.Errorf("GET /readyz as a role that may not replicate = %d, relay %+v: want 200, polling, naming the privilege and ORDER_RELAY_MODE", code, relay)
		}
		if out := logged.String(); !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "cannot stream the outbox by CDC") {
			t.Errorf("the log does not say why the relay polls:\n%s", out)
		}
	})

	t.Run("a service role does not migrate", func(t *testing.T) {
		if _, err := admin.Exec(ctx, `DELETE FROM orders.goose_db_version WHERE version_id = (SELECT max(version_id) FROM orders.goose_db_version)`); err != nil {
			t.Fatal(err)
		}
		err := Migrate(ctx, orderURL, order.Registration, log)
		if err == nil || !strings.Contains(err.Error(), "pending migrations") {
			t.Fatalf("Migrate as the role with a migration pending: %v, want a pending-migrations error", err)
		}
	})
}

func firstColumn(t *testing.T, admin *pgx.Conn, table string) string {
	t.Helper()
	var col string
	err := admin.QueryRow(t.Context(), `SELECT column_name FROM information_schema.columns
		WHERE table_schema = 'orders' AND table_name = $1 AND is_identity = 'NO' ORDER BY ordinal_position LIMIT 1`, table).Scan(&col)
	if err != nil {
		t.Fatal(err)
	}
	return pgx.Identifier{col}.Sanitize()
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprint(l.Addr())
}

func TestCreateRoleRefusesSuperuser(t *testing.T) {
	t.Parallel()
	dbURL, roles := roleDatabase(t)
	admin, err := pgx.Connect(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(t.Context(), "CREATE ROLE "+pgx.Identifier{roles["payment"]}.Sanitize()+" SUPERUSER"); err != nil {
		t.Fatal(err)
	}
	err = CreateRole(t.Context(), adminConfig(t, dbURL).Schemas(), "payment", roles["payment"], "payment-secret", nil)
	if err == nil || !strings.Contains(err.Error(), "SUPERUSER") {
		t.Fatalf("err %v, want a refusal", err)
	}
}

// adminConfig is the shop's configuration with every service on dbURL.
func adminConfig(t *testing.T, dbURL string) config.Config {
	t.Helper()
	cfg, err := LoadConfig(func(k string) string { return map[string]string{"DATABASE_URL": dbURL}[k] })
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}
