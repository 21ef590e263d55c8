package database

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestTransient(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&pgconn.PgError{Code: "53300"}, true},
		{&pgconn.PgError{Code: "57P03"}, true},
		{&pgconn.PgError{Code: "08006"}, true},
		{fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "53300"}), true},
		{&net.OpError{Op: "dial", Err: errors.New("connection refused")}, true},
		{context.DeadlineExceeded, true},
		{fmt.Errorf("commit: %w", io.ErrUnexpectedEOF), true}, // the connection dropped mid-answer
		{fmt.Errorf("create order: %w", pgconn.ErrConnClosed), true},
		{&pgconn.PgError{Code: "28P01"}, false}, // invalid_password
		{&pgconn.PgError{Code: "42501"}, false}, // insufficient_privilege
		{&pgconn.PgError{Code: "42601"}, false}, // syntax_error
		{errors.New("anything else"), false},
	} {
		if got := Transient(c.err); got != c.want {
			t.Errorf("Transient(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
