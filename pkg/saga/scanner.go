package saga

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// ScannerConfig configures a [Scanner].
type ScannerConfig struct {
	// PollInterval is how often the scanner looks for due timeouts when it
	// found none last time. Default 1s; a timeout fires at most this late.
	PollInterval time.Duration
	// RetryDelay is how long a timeout whose transition failed waits before
	// it is tried again, so that one failing timeout does not hold back the
	// others due after it. Default 10s.
	RetryDelay time.Duration
	// Logger receives the scanner's logs; nil discards them.
	Logger *slog.Logger
	// TracerProvider makes a span for each fired timeout, the parent of its
	// transition's span and a child of the span that armed the timeout (its
	// trace context is kept with it), so that an order's timeout belongs to
	// the order's trace. Default: nil, no spans.
	TracerProvider trace.TracerProvider
	// Hooks are where the scanner can be interrupted: no setting, and the
	// zero value is right outside tests and the chaos run.
	Hooks Hooks
}

// Hooks are the scanner's failure-injection points, not settings: what it
// does is the same with or without them. Zero fields are no-ops.
type Hooks struct {
	// FailpointFunc, when set, is called with FailpointAfterClaimTimeout
	// each time the scanner has claimed due timeouts. A non-nil error makes
	// the scanner behave as if it died there: the claim is rolled back, the
	// timeouts are not postponed, and they fire on a later scan. The shop
	// sets it to internal/failpoint.Inject.
	FailpointFunc func(name string) error
}

// FailpointAfterClaimTimeout is the scanner's failpoint: a due timeout and
// its instance are locked (uncommitted), nothing has been applied.
const FailpointAfterClaimTimeout = "saga.after_claim_timeout"

// Scanner fires due timeouts of its sagas. Several scanners, in one process
// or many, may run against one schema: each timeout fires once.
type Scanner struct {
	pool  *pgxpool.Pool
	sagas map[string]*Saga
	types []string
	cfg   ScannerConfig
	fired atomic.Int64
}

// NewScanner returns a Scanner for the timeouts of sagas; it does no I/O.
func NewScanner(pool *pgxpool.Pool, cfg ScannerConfig, sagas ...*Saga) (*Scanner, error) {
	if pool == nil || len(sagas) == 0 {
		return nil, errors.New("saga: NewScanner needs a pool and at least one saga")
	}
	cfg.PollInterval = cmp.Or(cfg.PollInterval, time.Second)
	cfg.RetryDelay = cmp.Or(cfg.RetryDelay, 10*time.Second)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = noop.NewTracerProvider()
	}
	s := &Scanner{pool: pool, sagas: map[string]*Saga{}, cfg: cfg}
	for _, sg := range sagas {
		s.sagas[sg.typ] = sg
		s.types = append(s.types, sg.typ)
	}
	return s, nil
}

// Fired returns how many timeouts this scanner has fired (committed) since
// it was created, for metrics and tests.
func (s *Scanner) Fired() int64 { return s.fired.Load() }

// Run fires due timeouts until ctx ends, then returns nil. Timeouts that fell
// due while no scanner ran fire on the first scan. A failing timeout is
// logged and retried on a later scan; it does not stop the others.
func (s *Scanner) Run(ctx context.Context) error {
	for {
		for {
			fired, err := s.fireOne(ctx)
			if err != nil && ctx.Err() == nil {
				s.cfg.Logger.Error("saga timeout failed", "err", err)
			}
			if !fired || err != nil || ctx.Err() != nil {
				break
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(s.cfg.PollInterval):
		}
	}
}

// fireOne fires one due timeout, if there is one, and reports whether it did.
// In one short transaction it claims the timeout and its instance with FOR
// UPDATE SKIP LOCKED (so concurrent scanners take different timeouts, and an
// instance busy with a transition is left for the next scan), deletes the
// timeout row and applies its event; a crash before the commit leaves the
// timeout in place to fire later.
//
// A scan that finds nothing costs two round trips (BEGIN with the claim,
// then ROLLBACK); a fired timeout costs three plus its func's reads: BEGIN
// with the claim, the transition's batch, COMMIT.
func (s *Scanner) fireOne(ctx context.Context) (bool, error) {
	var in Instance
	var name string
	var armed map[string]string // the trace context of the transaction that armed it
	claimed := false
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{}) // BEGIN rides with the claim: one round trip fewer
	b.Queue(claimSQL, s.types).QueryRow(func(row pgx.Row) error {
		err := row.Scan(&name, &in.ID, &in.Type, &in.State, &in.Version, &in.Data, &in.UpdatedAt, &armed)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		claimed = err == nil
		return err
	})
	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if err := br.Close(); err != nil {
		return false, fmt.Errorf("saga scanner: claim: %w", err)
	}
	if !claimed {
		return false, nil
	}
	// Failure window: the timeout is claimed by row locks and an
	// uncommitted delete only. Dying here rolls the claim back (the locks go
	// with the connection) and the timeout stays due for the next scan,
	// this scanner's or another's.
	if s.cfg.Hooks.FailpointFunc != nil {
		if err := s.cfg.Hooks.FailpointFunc(FailpointAfterClaimTimeout); err != nil {
			return false, fmt.Errorf("saga scanner: timeout %s/%s: %w", in.ID, name, err)
		}
	}
	ctx, span := s.cfg.TracerProvider.Tracer(tracerName).Start(traceContext.Extract(ctx, propagation.MapCarrier(armed)), "saga timeout "+name, trace.WithAttributes(
		attribute.String("saga.type", in.Type), attribute.String("saga.id", in.ID), attribute.String("saga.timeout", name)))
	defer span.End()
	// The claim locked the instance as Apply would have: apply it as read.
	res, err := s.sagas[in.Type].apply(ctx, tx, in, Event{Type: TimeoutEvent(name)})
	if err != nil {
		span.SetStatus(codes.Error, "timeout not applied")
		_ = tx.Rollback(ctx)
		// Postpone it, so the next scan moves on to the timeouts behind it.
		if _, perr := s.pool.Exec(ctx, `UPDATE saga_timeouts SET due_at = now() + $3::bigint * interval '1 microsecond'
			WHERE saga_id = $1 AND name = $2 AND due_at <= now()`, in.ID, name, s.cfg.RetryDelay.Microseconds()); perr != nil {
			err = errors.Join(err, fmt.Errorf("postpone timeout %s/%s: %w", in.ID, name, perr))
		}
		return false, err
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("saga scanner: commit timeout %s/%s: %w", in.ID, name, err)
	}
	s.fired.Add(1)
	s.cfg.Logger.Info("saga timeout fired", "saga", in.ID, "timeout", name, "applied", res.Applied, "from", res.From, "to", res.To)
	return true, nil
}

// claimSQL claims the earliest due timeout of the scanner's saga types and
// deletes it, returning its name and its instance. The instance columns come
// from the locking SELECT itself: a row locked after a concurrent update is
// returned as updated (Postgres re-reads it under the lock), where a second
// read of saga_instances in this statement would see its older snapshot.
const claimSQL = `
WITH due AS (
	SELECT t.saga_id, t.name, i.type, i.state, i.version, i.data, i.updated_at, t.trace_headers
	FROM saga_timeouts t JOIN saga_instances i ON i.id = t.saga_id
	WHERE t.due_at <= now() AND i.type = ANY($1)
	ORDER BY t.due_at
	LIMIT 1
	FOR UPDATE OF t, i SKIP LOCKED
)
DELETE FROM saga_timeouts t USING due
WHERE t.saga_id = due.saga_id AND t.name = due.name
RETURNING due.name, due.saga_id, due.type, due.state, due.version, due.data, due.updated_at, due.trace_headers`
