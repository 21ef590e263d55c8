package httpx

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestWriteProblem(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	for _, c := range []struct {
		name       string
		err        error
		status     int
		code       string
		retryAfter string
	}{
		{"a problem as it is", NewProblem(http.StatusNotFound, "order-not-found", "no"), 404, "order-not-found", ""},
		{"a problem's Retry-After in whole seconds, rounded up", NewProblem(http.StatusConflict, "request-in-flight", "").WithRetryAfter(1500 * time.Millisecond), 409, "request-in-flight", "2"},
		{"every 503 has a Retry-After", NewProblem(http.StatusServiceUnavailable, "overloaded", ""), 503, "overloaded", "1"},
		{"a dropped connection is 503", fmt.Errorf("create order: commit: %w", io.ErrUnexpectedEOF), 503, "dependency-unavailable", "1"},
		{"a terminated session is 503", fmt.Errorf("create order: %w", &pgconn.PgError{Code: "57P01"}), 503, "dependency-unavailable", "1"},
		{"an unreachable database is 503", &pgconn.ConnectError{}, 503, "dependency-unavailable", "1"},
		{"any other error is 500", errors.New("bug"), 500, "internal", ""},
		{"bad SQL is 500", &pgconn.PgError{Code: "42601"}, 500, "internal", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			rec := httptest.NewRecorder()
			WriteProblem(rec, httptest.NewRequest(http.MethodPost, "/orders", nil), log, c.err)
			var p Problem
			if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil {
				t.Fatal(err)
			}
			if rec.Code != c.status || p.Status != c.status || p.Code != c.code || rec.Header().Get("Retry-After") != c.retryAfter ||
				rec.Header().Get("Content-Type") != "application/problem+json" {
				t.Errorf("%d %s Retry-After %q, want %d %s Retry-After %q", rec.Code, rec.Body, rec.Header().Get("Retry-After"), c.status, c.code, c.retryAfter)
			}
			if c.code == "dependency-unavailable" && !strings.Contains(p.Detail, "same Idempotency-Key") {
				t.Errorf("detail %q does not say to retry with the same Idempotency-Key", p.Detail)
			}
		})
	}
}
