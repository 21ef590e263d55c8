package pgcluster_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/proof/pgcluster"
)

func query[T any](t *testing.T, url, sql string) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var v T
	if err := conn.QueryRow(ctx, sql).Scan(&v); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return v
}

// TestClusterKeepsItsDataAcrossRestarts: a private cluster runs with the
// settings given and those ModeCDC needs, keeps committed rows across a
// fast and an immediate restart, and is gone when the test ends.
func TestClusterKeepsItsDataAcrossRestarts(t *testing.T) {
	t.Parallel()
	var dir string
	t.Run("cluster", func(t *testing.T) {
		c := pgcluster.Start(t, map[string]string{"max_slot_wal_keep_size": "64MB"})
		dir = c.LogPath()
		if got := query[string](t, c.URL(), `SHOW wal_level`); got != "logical" {
			t.Errorf("wal_level = %s", got)
		}
		if got := query[string](t, c.URL(), `SHOW max_slot_wal_keep_size`); got != "64MB" {
			t.Errorf("max_slot_wal_keep_size = %s", got)
		}
		if got := query[string](t, c.URL(), `SELECT current_user`); got != "postgres" {
			t.Errorf("current_user = %s", got)
		}
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, c.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, `CREATE TABLE kept (n int); INSERT INTO kept VALUES (1)`); err != nil {
			t.Fatal(err)
		}
		for i, mode := range []pgcluster.Mode{pgcluster.Fast, pgcluster.Immediate} {
			if err := c.Restart(ctx, mode); err != nil {
				t.Fatalf("restart -m %s: %v", mode, err)
			}
			// The connection made before the restart is gone with it.
			if err := conn.Ping(ctx); err == nil {
				t.Errorf("restart -m %s: a connection from before still answers", mode)
			}
			if _, err := pgx.Connect(ctx, c.URL()); err != nil {
				t.Fatalf("after restart -m %s: %v", mode, err)
			}
			if got := query[int](t, c.URL(), `SELECT count(*)::int FROM kept`); got != i+1 {
				t.Fatalf("after restart -m %s: %d rows, want %d", mode, got, i+1)
			}
			conn.Close(ctx)
			if conn, err = pgx.Connect(ctx, c.URL()); err != nil {
				t.Fatal(err)
			}
			if _, err := conn.Exec(ctx, `INSERT INTO kept VALUES (1)`); err != nil {
				t.Fatal(err)
			}
		}
		if err := c.Stop(ctx, pgcluster.Fast); err != nil {
			t.Fatal(err)
		}
		if _, err := pgx.Connect(ctx, c.URL()); err == nil {
			t.Fatal("a stopped cluster takes connections")
		}
		if err := c.Start(ctx); err != nil {
			t.Fatal(err)
		}
		if got := query[int](t, c.URL(), `SELECT count(*)::int FROM kept`); got != 3 {
			t.Fatalf("after stop and start: %d rows, want 3", got)
		}
	})
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the cluster's directory is still there after its test: %v", err)
	}
}
