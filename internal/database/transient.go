package database

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Transient reports whether err is Postgres being unreachable or busy for
// now — refused or dropped connections, "too many clients", a server
// starting up or shutting down — rather than anything retrying cannot cure
// (a wrong password, a missing privilege, bad SQL). A connection dropped
// mid-request shows as an EOF from the socket or pgx's "conn closed"; when
// that happens during COMMIT the outcome is unknown, which only an
// idempotent retry can settle.
func Transient(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == "53300", // too_many_connections
			pgErr.Code == "57P03",               // cannot_connect_now: starting up
			pgErr.Code == "57P01",               // admin_shutdown
			pgErr.Code == "53000",               // insufficient_resources
			strings.HasPrefix(pgErr.Code, "08"): // connection_exception
			return true
		}
		return false
	}
	var netErr net.Error
	var connErr *pgconn.ConnectError
	return errors.As(err, &netErr) || errors.As(err, &connErr) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, pgconn.ErrConnClosed)
}

// Retry calls fn until it succeeds, returns an error Transient does not
// accept, or ctx ends, waiting between tries with capped, jittered backoff.
// It logs once when it starts waiting and once when it is through, so that
// a database that is down for minutes costs two lines, not hundreds. A
// process's start-up uses it: Postgres being away is no reason to exit.
func Retry(ctx context.Context, log *slog.Logger, what string, fn func(context.Context) error) error {
	wait, since := 250*time.Millisecond, time.Time{}
	for {
		err := fn(ctx)
		switch {
		case err == nil:
			if !since.IsZero() {
				log.Info(what+": the database answers again", "waited", time.Since(since).Round(time.Millisecond))
			}
			return nil
		case ctx.Err() != nil || !Transient(err):
			return err
		case since.IsZero():
			since = time.Now()
			log.Warn(what+": the database does not answer; retrying until it does", "err", err)
		default:
			log.Debug(what+": the database still does not answer", "err", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait/2 + rand.N(wait/2+1)):
		}
		wait = min(2*wait, 5*time.Second)
	}
}
