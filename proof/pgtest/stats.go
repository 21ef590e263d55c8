package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Postgres's cumulative statistics (pg_stat_user_tables and the like) reach
// the shared counters late: a session flushes what it counted at most once a
// second while it works, within about a second of going idle, and when it
// ends. A test that compares counters before and after some work must
// therefore settle the sessions that ran before the work, and wait for the
// work's own sessions to end, or it counts scans on the wrong side.

// NewAppPool opens another pool on the schema whose sessions carry
// application_name app, so that WaitSessionsEnded can tell when they are all
// gone. Closed when the test ends.
func (s *Schema) NewAppPool(t testing.TB, maxConns int32, app string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = s.Name
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// FlushStats makes every idle session of the schema's pool flush the
// statistics it has not reported yet; it returns once they are in the
// shared counters.
func (s *Schema) FlushStats(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	for _, c := range s.Pool.AcquireAllIdle(ctx) {
		// The flush happens as the session goes idle after this
		// statement, before Postgres answers ReadyForQuery.
		_, err := c.Exec(ctx, "SELECT pg_stat_force_next_flush()")
		c.Release()
		if err != nil {
			t.Fatalf("flush statistics: %v", err)
		}
	}
	// The pool's next query, the caller's reading, ends that idle moment.
	if _, err := s.Pool.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
}

// WaitSessionsEnded waits until no session with application_name app is
// connected. A session leaves pg_stat_activity only after it has flushed its
// statistics, so their counts are in once this returns.
func (s *Schema) WaitSessionsEnded(t testing.TB, app string) {
	t.Helper()
	if err := waitSessionsEnded(context.Background(), s.Pool, app); err != nil {
		t.Fatal(err)
	}
}

func waitSessionsEnded(ctx context.Context, pool *pgxpool.Pool, app string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n)
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

// withAppName returns connString with application_name set, in either of
// the two forms Postgres accepts (URL or key=value).
func withAppName(connString, app string) string {
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err == nil {
			q := u.Query()
			q.Set("application_name", app)
			u.RawQuery = q.Encode()
			return u.String()
		}
	}
	return connString + " application_name=" + app
}
