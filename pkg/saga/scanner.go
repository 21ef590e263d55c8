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
	// BatchSize is how many due timeouts one transaction claims and fires,
	// in due order. A transition that fails rolls the batch back, and the
	// same timeouts fire one per transaction, so the failing one is
	// postponed alone (RetryDelay) and holds none of the others back.
	// Default 64; 1 fires one timeout per transaction.
	BatchSize int
	// Logger receives the scanner's logs; default slog.Default().
	Logger *slog.Logger
	// TracerProvider makes a span for each fired timeout, a child of the
	// span that armed it. Default: nil, no spans.
	TracerProvider trace.TracerProvider
	// Hooks are failure injection for tests and chaos runs; leave them
	// zero.
	Hooks Hooks
}

// Hooks are the scanner's failure injection. Zero fields are no-ops.
type Hooks struct {
	// FailpointFunc, when set, is called with "saga.after_claim_timeout"
	// each time the scanner has claimed due timeouts, before it applies
	// them. A non-nil error makes the scanner behave as if it died there:
	// the claim is rolled back and the timeouts fire on a later scan.
	FailpointFunc func(name string) error
}

// failpointAfterClaimTimeout is the point at which the scanner calls
// Hooks.FailpointFunc: due timeouts and their instances are locked
// (uncommitted), nothing has been applied.
const failpointAfterClaimTimeout = "saga.after_claim_timeout"

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
	cfg.BatchSize = cmp.Or(cfg.BatchSize, 64)
	if cfg.BatchSize < 1 {
		return nil, fmt.Errorf("saga: ScannerConfig.BatchSize %d must be positive", cfg.BatchSize)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
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
			n, err := s.fire(ctx, s.cfg.BatchSize)
			if err != nil && ctx.Err() == nil {
				s.cfg.Logger.Error("saga timeout failed", "err", err)
			}
			if n < s.cfg.BatchSize || err != nil || ctx.Err() != nil {
				break // drained; a full batch means more may be due now
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(s.cfg.PollInterval):
		}
	}
}

// fire fires up to limit due timeouts and returns how many it fired. In
// one short transaction it claims them and their instances with FOR UPDATE
// SKIP LOCKED (so concurrent scanners take different timeouts, and an
// instance busy with a transition is left for the next scan), deletes the
// timeout rows and applies their events in due order; a crash before the
// commit leaves every one of them in place to fire later. When a
// transition fails, the whole claim is rolled back and the same timeouts
// are fired one per transaction: only the failing one is postponed.
//
// A scan that finds nothing costs two round trips (BEGIN with the claim,
// then ROLLBACK); fired timeouts cost two plus one per transition (its
// batch) and its func's reads: BEGIN with the claim, the transitions,
// COMMIT — one transaction for up to limit timeouts.
func (s *Scanner) fire(ctx context.Context, limit int) (int, error) {
	type claim struct {
		in    Instance
		name  string
		armed map[string]string // the trace context of the transaction that armed it
	}
	var claims []claim
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{}) // BEGIN rides with the claim: one round trip fewer
	b.Queue(claimSQL, s.types, limit).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var c claim
			if err := rows.Scan(&c.name, &c.in.ID, &c.in.Type, &c.in.State, &c.in.Version, &c.in.Data, &c.in.UpdatedAt, &c.armed); err != nil {
				return err
			}
			claims = append(claims, c)
		}
		return rows.Err()
	})
	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if err := br.Close(); err != nil {
		return 0, fmt.Errorf("saga scanner: claim: %w", err)
	}
	if len(claims) == 0 {
		return 0, nil
	}
	// Failure window: the timeouts are claimed by row locks and uncommitted
	// deletes only. Dying here rolls the claim back (the locks go with the
	// connection) and the timeouts stay due for the next scan, this
	// scanner's or another's.
	if s.cfg.Hooks.FailpointFunc != nil {
		if err := s.cfg.Hooks.FailpointFunc(failpointAfterClaimTimeout); err != nil {
			return 0, fmt.Errorf("saga scanner: %d timeouts from %s/%s: %w", len(claims), claims[0].in.ID, claims[0].name, err)
		}
	}
	type done struct {
		claim
		res Result
	}
	var fired []done
	applied := map[string]bool{} // instances a transition of this batch moved already
	for _, c := range claims {
		res, err := s.fireClaimed(ctx, tx, c.in, c.name, c.armed, applied[c.in.ID])
		if err != nil {
			if limit == 1 {
				_ = tx.Rollback(ctx)
				// Postpone it, so the next scan moves on to the timeouts behind it.
				if _, perr := s.pool.Exec(ctx, `UPDATE saga_timeouts SET due_at = now() + $3::bigint * interval '1 microsecond'
					WHERE saga_id = $1 AND name = $2 AND due_at <= now()`, c.in.ID, c.name, s.cfg.RetryDelay.Microseconds()); perr != nil {
					err = errors.Join(err, fmt.Errorf("postpone timeout %s/%s: %w", c.in.ID, c.name, perr))
				}
				return 0, err
			}
			// One bad transition must not hold back the others: roll back
			// and fire the same timeouts one per transaction.
			_ = tx.Rollback(ctx)
			s.cfg.Logger.Debug("saga timeouts not fired as one batch; one at a time", "timeouts", len(claims), "err", err)
			return s.fireAlone(ctx, len(claims))
		}
		applied[c.in.ID] = true
		fired = append(fired, done{c, res})
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("saga scanner: commit %d timeouts: %w", len(claims), err)
	}
	s.fired.Add(int64(len(fired)))
	for _, f := range fired {
		s.cfg.Logger.Info("saga timeout fired", "saga", f.in.ID, "timeout", f.name, "applied", f.res.Applied, "from", f.res.From, "to", f.res.To)
	}
	return len(fired), nil
}

// fireClaimed applies the timeout name of instance in, claimed in tx, under
// a span that continues the trace that armed it. again says a transition
// of this transaction moved the instance already, so in is stale: the
// instance is read again (under the lock tx holds).
func (s *Scanner) fireClaimed(ctx context.Context, tx pgx.Tx, in Instance, name string, armed map[string]string, again bool) (Result, error) {
	ctx, span := s.cfg.TracerProvider.Tracer(tracerName).Start(traceContext.Extract(ctx, propagation.MapCarrier(armed)), "saga timeout "+name, trace.WithAttributes(
		attribute.String("saga.type", in.Type), attribute.String("saga.id", in.ID), attribute.String("saga.timeout", name)))
	defer span.End()
	ev := Event{Type: TimeoutEvent(name)}
	var (
		res Result
		err error
	)
	if again {
		res, err = s.sagas[in.Type].Apply(ctx, tx, in.ID, ev)
	} else {
		// The claim locked the instance as Apply would have: apply it as read.
		var results []Result
		results, err = s.sagas[in.Type].applyLocked(ctx, tx, map[string]*Instance{in.ID: &in}, []BatchEvent{{Ctx: ctx, ID: in.ID, Event: ev}})
		if err == nil {
			res = results[0]
		}
	}
	if err != nil {
		span.SetStatus(codes.Error, "timeout not applied")
		return Result{}, fmt.Errorf("saga scanner: timeout %s/%s: %w", in.ID, name, err)
	}
	return res, nil
}

// fireAlone fires up to n due timeouts one per transaction, after a batch
// of n failed, and returns how many it fired. Errors are logged: each
// failing timeout is postponed, the others fire.
func (s *Scanner) fireAlone(ctx context.Context, n int) (int, error) {
	total := 0
	for range n {
		k, err := s.fire(ctx, 1)
		if err != nil {
			if ctx.Err() != nil {
				return total, err
			}
			s.cfg.Logger.Error("saga timeout failed", "err", err)
			continue
		}
		if k == 0 {
			break
		}
		total += k
	}
	return total, nil
}

// claimSQL claims the earliest due timeouts of the scanner's saga types, up
// to $2, and deletes them, returning their names and their instances in
// due order. The instance columns come
// from the locking SELECT itself: a row locked after a concurrent update is
// returned as updated (Postgres re-reads it under the lock), where a second
// read of saga_instances in this statement would see its older snapshot.
const claimSQL = `
WITH due AS (
	SELECT t.saga_id, t.name, t.due_at, i.type, i.state, i.version, i.data, i.updated_at, t.trace_headers
	FROM saga_timeouts t JOIN saga_instances i ON i.id = t.saga_id
	WHERE t.due_at <= now() AND i.type = ANY($1)
	ORDER BY t.due_at
	LIMIT $2
	FOR UPDATE OF t, i SKIP LOCKED
), gone AS (
	DELETE FROM saga_timeouts t USING due
	WHERE t.saga_id = due.saga_id AND t.name = due.name
	RETURNING due.name, due.saga_id, due.type, due.state, due.version, due.data, due.updated_at, due.trace_headers, due.due_at
)
SELECT name, saga_id, type, state, version, data, updated_at, trace_headers FROM gone ORDER BY due_at`
