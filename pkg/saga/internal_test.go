package saga

import (
	"context"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A ScannerConfig without a Logger logs to slog.Default(), as pkg/outbox
// and pkg/inbox do: a timeout that fails to fire is an operator's to see.
func TestLoggerDefaultsToSlogDefault(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // never dialled: NewScanner does no I/O
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	sg, err := New("t")
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewScanner(pool, ScannerConfig{}, sg)
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.Logger != slog.Default() {
		t.Fatalf("default Logger %v, want slog.Default()", s.cfg.Logger)
	}
}

// FireOne is fire for the external tests: fire one due timeout in a
// transaction of its own and say whether one fired. Only tests see it;
// `go doc` never does.
func (s *Scanner) FireOne(ctx context.Context) (bool, error) {
	n, err := s.fire(ctx, 1)
	return n > 0, err
}

// Fire is fire for the external tests: fire up to limit due timeouts in one
// transaction and return how many fired.
func (s *Scanner) Fire(ctx context.Context, limit int) (int, error) { return s.fire(ctx, limit) }
