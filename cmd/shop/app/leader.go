package app

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// leader elects one process among copies by a Postgres session advisory
// lock, held on a connection of its own for as long as the process leads.
// The lock goes with the session: a process that dies, or loses its
// connection, lets another copy take it at its next try. No lease to
// expire, no clock to trust.
type leader struct {
	url string
	key int64
	log *slog.Logger

	mu   sync.Mutex
	conn *pgx.Conn // open while this process holds the lock
}

// hold reports whether this process holds the lock, taking it when it is
// free. A held lock is checked on its connection first: a connection the
// database has lost no longer holds it.
func (l *leader) hold(ctx context.Context) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if l.conn != nil {
		if err := l.conn.Ping(ctx); err == nil {
			return true
		}
		l.log.Warn("the reconciler's lock was lost with its connection; another copy may run it now")
		_ = l.conn.Close(context.WithoutCancel(ctx))
		l.conn = nil
	}
	conn, err := pgx.Connect(ctx, l.url)
	if err != nil {
		l.log.Debug("cannot try the reconciler's lock", "err", err)
		return false
	}
	var got bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, l.key).Scan(&got); err != nil || !got {
		_ = conn.Close(context.WithoutCancel(ctx))
		return false
	}
	l.conn = conn
	l.log.Info("this process runs the shop's reconciler (it holds the lock; other copies stand by)")
	return true
}

// release gives the lock up, for a clean stop: another copy takes it at
// its next try.
func (l *leader) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = l.conn.Close(ctx)
		l.conn = nil
	}
}
