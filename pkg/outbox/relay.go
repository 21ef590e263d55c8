package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"
)

// Relay publishes committed outbox events to JetStream. Several relays, in
// one process or many, may run against one schema: their claims keep them
// apart.
type Relay struct {
	pool   *pgxpool.Pool
	nc     *nats.Conn
	js     jetstream.JetStream
	cfg    Config
	log    *slog.Logger
	schema string
	slot   string // ModeCDC: the replication slot and publication, set by Run
	// slotName is slot for State, which may be called before Run sets it.
	slotName atomic.Pointer[string]
	cdc      cdcState
	kick     chan struct{} // one idle worker takes each wake-up
	tracer   trace.Tracer  // from Config.TracerProvider; nil: no spans
	stats    counters
	// jitter draws a backoff's random part: rand.Int64N, except in tests
	// that must know how long a backoff is.
	jitter func(n int64) int64
}

type counters struct {
	published, duplicates, retried, dead, lostLeases, takenOver, outages, deferred atomic.Int64
	lastPublish, downSince                                                         atomic.Int64 // unix nanoseconds; 0: never, not down
	noStreamLogged                                                                 atomic.Int64 // unix nanoseconds of the last "no stream" warning
}

// Counters are running totals of one relay, for metrics and tests.
type Counters struct {
	Published  int64 // events acked by the broker and marked published
	Duplicates int64 // acks the broker flagged as duplicates (an earlier copy was stored)
	Retried    int64 // transient failures scheduled for another attempt
	Dead       int64 // events made dead
	LostLeases int64 // acked events whose lease had passed to another relay before marking
	TakenOver  int64 // claims of events whose earlier lease had expired unsettled (a relay died or stalled)
	Outages    int64 // times the broker stopped taking anything (connection down, JetStream unavailable, no acks)
	Deferred   int64 // events handed back without an attempt counted, because the broker took nothing
}

// NewRelay returns a relay for the outbox in the schema that pool's
// connections use (their search_path).
func NewRelay(pool *pgxpool.Pool, js jetstream.JetStream, cfg Config) (*Relay, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	// A JetStream context of our own, so that the relay's ack timeout and
	// in-flight limit do not depend on how the caller configured theirs.
	ownJS, err := jetstream.New(js.Conn(),
		jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout),
		jetstream.WithPublishAsyncMaxPending(cfg.BatchSize*cfg.Workers))
	if err != nil {
		return nil, fmt.Errorf("relay jetstream context: %w", err)
	}
	r := &Relay{pool: pool, nc: js.Conn(), js: ownJS, cfg: cfg, log: cfg.Logger.With("relay", cfg.Name), jitter: rand.Int64N}
	r.kick = make(chan struct{}, 1)
	if cfg.TracerProvider != nil {
		r.tracer = cfg.TracerProvider.Tracer("github.com/shop-ref/shop/pkg/outbox")
	}
	return r, nil
}

// Counters returns the relay's running totals.
func (r *Relay) Counters() Counters {
	return Counters{
		Published: r.stats.published.Load(), Duplicates: r.stats.duplicates.Load(),
		Retried: r.stats.retried.Load(), Dead: r.stats.dead.Load(), LostLeases: r.stats.lostLeases.Load(),
		TakenOver: r.stats.takenOver.Load(), Outages: r.stats.outages.Load(), Deferred: r.stats.deferred.Load(),
	}
}

// State is how a relay stands with the broker, and in ModeCDC with its
// slot, now.
type State struct {
	UnavailableSince time.Time // while the broker takes nothing: since when; zero otherwise
	LastPublish      time.Time // when the broker last acked an event of this relay; zero before the first

	Mode      Mode   // the configured mode
	Slot      string // ModeCDC: the slot; empty until Run has read the schema
	Streaming bool   // ModeCDC: this relay streams the slot now (else another does, or none can)
	// CDCUnavailable, in ModeCDC, says why the database cannot serve it
	// (a setting, a privilege); the relay polls the table meanwhile.
	CDCUnavailable string
	HandedOff      int64 // ModeCDC: events the stream left to the table's poller
}

// State returns the relay's state, for readiness reports and metrics.
func (r *Relay) State() State {
	st := State{
		UnavailableSince: unixNano(r.stats.downSince.Load()), LastPublish: unixNano(r.stats.lastPublish.Load()),
		Mode: r.cfg.Mode, Streaming: r.cdc.streaming.Load(), HandedOff: r.cdc.handedOff.Load(),
	}
	if p := r.slotName.Load(); p != nil {
		st.Slot = *p
	}
	if why := r.cdc.unavailable.Load(); why != nil {
		st.CDCUnavailable = *why
	}
	return st
}

func unixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// Run relays events until ctx ends, then finishes the batches in flight and
// returns nil. Neither the database nor the broker being away ends it.
//
// When the broker takes nothing (the connection down, JetStream unavailable
// or silent, no stream for a subject), the batch is handed back with no
// attempt counted and the relay pauses, claiming nothing until JetStream
// answers again, so a relay cut off alone leaves the events to the others.
// Only an event's own failure can make it dead.
func (r *Relay) Run(ctx context.Context) error {
	// The schema names the LISTEN channel. The database may not answer yet
	// (down, starting, out of connections): wait for it, as for everything
	// else the relay does.
	for failures := 1; ; failures++ {
		var database string
		err := r.pool.QueryRow(ctx, "SELECT current_schema(), current_database()").Scan(&r.schema, &database)
		if err == nil {
			r.slot = cmp.Or(r.cfg.Slot, SlotName(database, r.schema))
			break
		}
		if ctx.Err() != nil {
			return nil
		}
		if failures == 1 {
			r.log.Warn("outbox relay: cannot read its schema yet; retrying", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, failures, r.jitter)):
		}
	}
	g, ctx := errgroup.WithContext(ctx)
	if !r.cfg.DisableListen {
		g.Go(func() error { r.listen(ctx); return nil })
	}
	g.Go(func() error { r.retain(ctx); return nil })
	g.Go(func() error { r.stayAlive(ctx); return nil })
	workers := r.cfg.Workers
	if r.cfg.Mode == ModeCDC {
		r.slotName.Store(&r.slot)
		g.Go(func() error { r.stream(ctx); return nil })
		// The poller publishes only what the stream leaves to the table,
		// unless the database cannot stream (then it is the relay).
		workers = 1
	} else {
		g.Go(func() error { r.watchLeftoverSlot(ctx); return nil })
	}
	for range workers {
		g.Go(func() error { r.work(ctx); return nil })
	}
	return g.Wait()
}

func (r *Relay) work(ctx context.Context) {
	failures, outages := 0, 0
	for ctx.Err() == nil {
		n, next, err := r.relayBatch(ctx)
		var down *unavailableError
		switch {
		case ctx.Err() != nil:
		case errors.As(err, &down):
			outages++
			r.brokerDown(down)
		case err != nil:
			failures++
			r.log.Warn("outbox relay batch failed", "err", err, "failures", failures)
		default:
			failures, outages = 0, 0
			if n > 0 {
				r.brokerUp()
			}
		}
		if (n == r.cfg.BatchSize || next) && failures == 0 && outages == 0 {
			continue // a full batch, or events it unblocked: more are waiting
		}
		wait := r.cfg.PollInterval
		switch {
		case outages > 0:
			wait = backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, outages, r.jitter)
		case failures > 0:
			wait = backoff(r.cfg.BackoffBase, r.cfg.BackoffMax, failures, r.jitter)
		}
		select {
		case <-ctx.Done():
		case <-r.kick:
		case <-time.After(wait):
		}
	}
}

// relayBatch claims, publishes and marks one batch; it returns how many events it claimed,
// whether an event it marked has its aggregate's next event waiting (look
// again at once), and an *unavailableError when the broker took none of them for reasons
// of its own.
func (r *Relay) relayBatch(ctx context.Context) (n int, next bool, err error) {
	if st := r.nc.Status(); st != nats.CONNECTED {
		// While the broker is unreachable every publish would fail; the
		// events wait, unclaimed, in the outbox instead.
		return 0, false, &unavailableError{fmt.Errorf("nats connection %s", st)}
	}
	down := r.stats.downSince.Load() != 0
	if down {
		// Ask JetStream itself before claiming anything: a relay that
		// cannot reach it (a partition of this process alone, say) must
		// leave the events to the relays that can, not hold one after
		// another for a publish timeout.
		if err := r.probe(ctx); err != nil {
			return 0, false, &unavailableError{err}
		}
	}
	token := uuid.New()
	batch, err := r.claim(ctx, token)
	if err != nil || len(batch) == 0 {
		if err == nil && down {
			r.brokerUp() // JetStream answers and there is nothing to send
		}
		return 0, false, err
	}
	// Failure window: the lease is committed, nothing is published. The
	// batch waits for the lease to expire; then any relay takes it over.
	if err := r.cfg.failpoint(failpointAfterClaim); err != nil {
		return len(batch), false, err
	}
	claimed := time.Now()
	for i := range batch {
		batch[i].since = claimed
	}
	// The claim is committed. From here the batch is finished even if ctx
	// ends, so a shutdown leaves no claimed-but-unmarked rows behind.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout+r.cfg.LeaseDuration/2)
	defer cancel()
	results, err := r.publish(ctx, batch)
	if err != nil {
		return len(batch), false, err // "died" part way: nothing is settled, the lease expires
	}
	next, err = r.settle(ctx, token, batch, results)
	if err != nil {
		return len(batch), false, err
	}
	return len(batch), next, verdict(results)
}

// backoff is exponential with full jitter: a delay in (0, base·2^(attempt-1)],
// capped, drawn by jitter (rand.Int64N), so relays retrying together spread out.
func backoff(base, ceiling time.Duration, attempt int, jitter func(int64) int64) time.Duration {
	d := ceiling
	if attempt < 31 {
		d = min(ceiling, base<<(attempt-1))
	}
	return time.Duration(jitter(int64(d)) + 1)
}
