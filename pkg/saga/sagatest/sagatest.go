// Package sagatest helps the tests of code that runs sagas with pkg/saga:
// fire a saga's timeout now instead of waiting for it, and look at what
// the saga's tables hold without knowing them.
//
//	sagatest.RequireTimeout(t, pool, orderID, "payment")
//	in := sagatest.FireTimeout(t, pool, orderSaga, orderID, "payment")
//	// in.State == "CANCELLED"
//
// The db arguments are anything that reads the saga's schema: a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
package sagatest

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/pkg/saga"
)

// FireTimeout makes the timeout name of the instance id due now and fires
// it as the saga's Scanner does, through a Scanner of sg (its claim, its
// transition, its commit), and returns the instance afterwards. It fails t
// when no such timeout is armed, when its transition fails, or when it has
// not fired within ten seconds (sg must be the instance's saga). Other
// timeouts of sg that are already due may fire with it, as they would on
// any scan.
func FireTimeout(t testing.TB, pool *pgxpool.Pool, sg *saga.Saga, id, name string) saga.Instance {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// -infinity: first in due order, and no due time the saga can set.
	tag, err := pool.Exec(ctx, `UPDATE saga_timeouts SET due_at = '-infinity' WHERE saga_id = $1 AND name = $2`, id, name)
	if err != nil {
		t.Fatalf("sagatest: make timeout %s of %s due: %v", name, id, err)
	}
	if tag.RowsAffected() == 0 {
		t.Fatalf("sagatest: saga %s has no timeout %q armed", id, name)
	}
	var logs syncBuffer
	sc, err := saga.NewScanner(pool, saga.ScannerConfig{
		PollInterval: 5 * time.Millisecond, BatchSize: 1,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}, sg)
	if err != nil {
		t.Fatalf("sagatest: %v", err)
	}
	scanCtx, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- sc.Run(scanCtx) }()
	defer func() { stop(); <-stopped }()

	for {
		var infinite bool
		err := pool.QueryRow(ctx, `SELECT due_at = '-infinity' FROM saga_timeouts WHERE saga_id = $1 AND name = $2`, id, name).
			Scan(&infinite)
		switch {
		case errors.Is(err, pgx.ErrNoRows): // fired: its transition committed with the delete
			in, err := saga.Load(ctx, pool, id)
			if err != nil {
				t.Fatalf("sagatest: load saga %s after its timeout %s: %v", id, name, err)
			}
			return in
		case err != nil:
			t.Fatalf("sagatest: read timeout %s of %s: %v", name, id, err)
		case !infinite: // the scanner postponed it: the transition failed
			for logs.String() == "" && ctx.Err() == nil { // the scanner logs why just after
				time.Sleep(time.Millisecond)
			}
			t.Fatalf("sagatest: timeout %s of %s did not fire: %s", name, id, logs.String())
		}
		select {
		case <-ctx.Done():
			t.Fatalf("sagatest: timeout %s of %s did not fire within 10s (is sg the saga of instance %s?) %s", name, id, id, logs.String())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// DB is what the reading functions need: a *pgxpool.Pool, a *pgx.Conn or
// a pgx.Tx.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Timeouts returns the timeouts armed for the instance id, by name, with
// when each falls due.
func Timeouts(t testing.TB, db DB, id string) map[string]time.Time {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT name, due_at FROM saga_timeouts WHERE saga_id = $1`, id)
	if err != nil {
		t.Fatalf("sagatest: read the timeouts of %s: %v", id, err)
	}
	out := map[string]time.Time{}
	var name string
	var due time.Time
	_, err = pgx.ForEachRow(rows, []any{&name, &due}, func() error {
		out[name] = due
		return nil
	})
	if err != nil {
		t.Fatalf("sagatest: read the timeouts of %s: %v", id, err)
	}
	return out
}

// RequireTimeout fails t unless the timeout name is armed for the instance
// id, and returns when it falls due.
func RequireTimeout(t testing.TB, db DB, id, name string) time.Time {
	t.Helper()
	due, ok := Timeouts(t, db, id)[name]
	if !ok {
		t.Fatalf("sagatest: saga %s has no timeout %q armed", id, name)
	}
	return due
}

// Unexpected is an event that arrived at a saga instance in a state with no
// transition for it: Apply recorded it and changed nothing.
type Unexpected struct {
	State     string // the instance's state then; "" when there was no instance
	EventType string
	EventID   string
}

// UnexpectedEvents returns the unexpected events recorded for the instance
// id, oldest first.
func UnexpectedEvents(t testing.TB, db DB, id string) []Unexpected {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT coalesce(state, ''), event_type, coalesce(event_id, '')
		FROM saga_unexpected WHERE saga_id = $1 ORDER BY id`, id)
	if err != nil {
		t.Fatalf("sagatest: read the unexpected events of %s: %v", id, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Unexpected])
	if err != nil {
		t.Fatalf("sagatest: read the unexpected events of %s: %v", id, err)
	}
	return out
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
