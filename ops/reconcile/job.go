package reconcile

import (
	"cmp"
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/shop-ref/shop/ops/verify"
)

// Job runs Run periodically and keeps the last run's counts for metrics.
type Job struct {
	Shop     verify.Shop
	Config   Config
	Interval time.Duration // default 1m
	Logger   *slog.Logger  // default slog.Default()
	// Leader, when set, is asked before each run whether this process is
	// the one that runs the job now (several copies of a service run it,
	// one at a time); nil: always.
	Leader func(ctx context.Context) bool

	last    atomic.Pointer[Counts]
	runs    atomic.Int64
	leading atomic.Bool
}

// Leading reports whether this process ran the job at its last tick (with
// Leader: whether it was the leader then).
func (j *Job) Leading() bool { return j.leading.Load() }

// Last returns the counts of the last completed run (zero before the first)
// and how many runs completed.
func (j *Job) Last() (Counts, int64) {
	if c := j.last.Load(); c != nil {
		return *c, j.runs.Load()
	}
	return Counts{}, j.runs.Load()
}

// Run reconciles every Interval until ctx ends. A failed run is logged and
// retried at the next tick: the job never stops the process.
func (j *Job) Run(ctx context.Context) error {
	log := cmp.Or(j.Logger, slog.Default())
	t := time.NewTicker(cmp.Or(j.Interval, time.Minute))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if j.Leader != nil && !j.Leader(ctx) {
			j.leading.Store(false)
			continue
		}
		j.leading.Store(true)
		if _, err := j.Once(ctx); err != nil && ctx.Err() == nil {
			log.Warn("reconcile failed", "err", err)
		}
	}
}

// Once runs the reconciler once, logs each finding and records the counts.
func (j *Job) Once(ctx context.Context) (Report, error) {
	log := cmp.Or(j.Logger, slog.Default())
	rep, err := Run(ctx, j.Shop, j.Config)
	if err != nil {
		return rep, err
	}
	for _, f := range rep.Findings {
		log.Warn("reconcile: "+string(f.Kind), "order_id", f.OrderID, "detail", f.Detail, "republished", f.Republished)
	}
	for _, q := range rep.Requeued {
		log.Warn("reconcile: requeued a dead event; it had died of a missing stream", "service", q.Service,
			"event_id", q.EventID, "event_type", q.Type, "aggregate_id", q.AggregateID)
	}
	for _, a := range rep.Audits {
		if a.Err != nil {
			log.Warn("reconcile: stream not audited", "service", a.Service, "stream", a.Stream, "err", a.Err)
		}
	}
	c := rep.Counts
	j.last.Store(&c)
	j.runs.Add(1)
	return rep, nil
}
