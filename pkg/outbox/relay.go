package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// Config configures a Relay. Zero fields take the defaults named beside them.
type Config struct {
	Name           string        // relay id stored in claimed_by; default host-pid-random
	BatchSize      int           // events claimed per batch; default 500
	Workers        int           // claim-publish-mark loops per relay, overlapping their round trips; default 2
	PollInterval   time.Duration // fallback when no NOTIFY arrives; default 1s
	LeaseDuration  time.Duration // how long a claim lasts; default 15s
	PublishTimeout time.Duration // wait for a batch's acks; default 3s, at most half the lease
	BackoffBase    time.Duration // first retry delay after a transient failure; default 250ms
	BackoffMax     time.Duration // cap of the exponential backoff; default 30s
	MaxAttempts    int           // failures of an event's own before it is dead; default 10

	// OutageBackoffMax caps the pause between two tries while the broker
	// takes nothing (see Relay.Run); short, so that publishing resumes
	// within about this long of the broker's return. Default 2s.
	OutageBackoffMax time.Duration

	Retention         time.Duration // published rows older than this are deleted; default 72h
	RetentionInterval time.Duration // how often to delete; default 1m
	RetentionBatch    int           // rows per delete statement; default 1000

	Logger *slog.Logger // default slog.Default()

	// DisableListen turns the NOTIFY wake-up off: the relay holds no LISTEN
	// connection and finds new events by polling every PollInterval (and
	// after each full batch) only. For measuring what the wake-up buys, and
	// for connection poolers that cannot LISTEN. Default false: listen.
	DisableListen bool

	// ObservePublishFunc, when set, is called once per acked event with the
	// time from the commit of its claim to the relay reading its ack: the
	// publish latency of the event. It is called from the relay's workers
	// and must be safe for concurrent use and quick. Default: none.
	ObservePublishFunc func(time.Duration)

	// FailpointFunc, when set, is called with the name of each failpoint
	// the relay passes (the Failpoint* constants); a non-nil error makes
	// the relay behave as if it died there: it abandons the batch without
	// publishing or marking the rest, and the lease expires. The shop sets
	// it to internal/failpoint.Inject; the library never needs it.
	// Default: none.
	FailpointFunc func(name string) error
}

// The failpoints of the outbox, passed to Config.FailpointFunc.
const (
	// FailpointAfterClaim is hit once per batch, after its claim committed
	// and before anything is published.
	FailpointAfterClaim = "outbox.after_claim"
	// FailpointBeforePublish is hit once per event, just before the event
	// is handed to the broker: dying there leaves the earlier events of the
	// batch perhaps stored in the stream and the later ones not.
	FailpointBeforePublish = "outbox.before_publish"
	// FailpointAfterAckBeforeMark is hit once per batch with at least one
	// acked event, after the acks were read and before they are marked.
	FailpointAfterAckBeforeMark = "outbox.after_ack_before_mark"
	// FailpointRetentionMidBatch is hit by the relay's retention between
	// two delete statements, after a full batch was deleted.
	FailpointRetentionMidBatch = "outbox.retention_mid_batch"
)

func (c *Config) failpoint(name string) error {
	if c.FailpointFunc == nil {
		return nil
	}
	return c.FailpointFunc(name)
}

func (c *Config) setDefaults() {
	if c.Name == "" {
		host, _ := os.Hostname()
		c.Name = fmt.Sprintf("%s-%d-%04x", cmp.Or(host, "relay"), os.Getpid(), rand.Uint32()&0xffff)
	}
	c.BatchSize = cmp.Or(c.BatchSize, 500)
	c.Workers = cmp.Or(c.Workers, 2)
	c.PollInterval = cmp.Or(c.PollInterval, time.Second)
	c.LeaseDuration = cmp.Or(c.LeaseDuration, 15*time.Second)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, min(3*time.Second, c.LeaseDuration/3))
	c.BackoffBase = cmp.Or(c.BackoffBase, 250*time.Millisecond)
	c.BackoffMax = cmp.Or(c.BackoffMax, 30*time.Second)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, 10)
	c.OutageBackoffMax = cmp.Or(c.OutageBackoffMax, 2*time.Second)
	c.Retention = cmp.Or(c.Retention, 72*time.Hour)
	c.RetentionInterval = cmp.Or(c.RetentionInterval, time.Minute)
	c.RetentionBatch = cmp.Or(c.RetentionBatch, 1000)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *Config) validate() error {
	switch {
	case c.BatchSize < 1 || c.Workers < 1 || c.MaxAttempts < 1 || c.RetentionBatch < 1:
		return errors.New("outbox relay: BatchSize, Workers, MaxAttempts and RetentionBatch must be positive")
	case c.PublishTimeout*2 > c.LeaseDuration:
		// A batch must be marked while its lease still holds, or another
		// relay publishes it again on every round.
		return fmt.Errorf("outbox relay: PublishTimeout %v must be at most half of LeaseDuration %v", c.PublishTimeout, c.LeaseDuration)
	case c.BackoffBase > c.BackoffMax || c.BackoffBase > c.OutageBackoffMax:
		return fmt.Errorf("outbox relay: BackoffBase %v exceeds BackoffMax %v or OutageBackoffMax %v", c.BackoffBase, c.BackoffMax, c.OutageBackoffMax)
	}
	return nil
}

// RetryHorizon bounds how long after an event's first publish the relay may
// publish another copy of it while the broker works: every attempt that
// counts may wait out a lease, a publish timeout and a full backoff. While
// the broker takes nothing at all (see Relay.Run) the relay publishes
// nothing and counts nothing, so an outage stretches this by its length:
// a copy whose first publish the broker stored without the ack reaching
// the relay can then come after the stream's duplicate window, and the
// consumers' inboxes absorb it. Consumers must remember event ids longer
// than this (see pkg/inbox), and the stream's duplicate window should be
// longer too, so that it drops the copies of ordinary retries.
func (c Config) RetryHorizon() time.Duration {
	c.setDefaults()
	return time.Duration(c.MaxAttempts) * (c.LeaseDuration + c.PublishTimeout + c.BackoffMax)
}

// Relay publishes committed outbox events to JetStream. Several relays, in
// one process or many, may run against one schema: claims keep them apart.
type Relay struct {
	pool   *pgxpool.Pool
	nc     *nats.Conn
	js     jetstream.JetStream
	cfg    Config
	log    *slog.Logger
	schema string
	kick   chan struct{} // one idle worker takes each wake-up
	stats  counters
}

type counters struct {
	published, duplicates, retried, dead, lostLeases, takenOver, outages, deferred atomic.Int64
	lastPublish, downSince                                                         atomic.Int64 // unix nanoseconds; 0: never, not down
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
	r := &Relay{pool: pool, nc: js.Conn(), js: ownJS, cfg: cfg, log: cfg.Logger.With("relay", cfg.Name)}
	r.kick = make(chan struct{}, 1)
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

// State is how a relay stands with the broker now.
type State struct {
	UnavailableSince time.Time // while the broker takes nothing: since when; zero otherwise
	LastPublish      time.Time // when the broker last acked an event of this relay; zero before the first
}

// State returns the relay's state, for readiness reports and metrics.
func (r *Relay) State() State {
	return State{UnavailableSince: unixNano(r.stats.downSince.Load()), LastPublish: unixNano(r.stats.lastPublish.Load())}
}

func unixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// wake wakes the relay to look for new events now. It never blocks. One
// waiting worker wakes; busy workers look again anyway when they finish a
// full batch.
func (r *Relay) wake() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// Run relays events until ctx ends, then finishes the batches in flight and
// returns nil. Neither the database nor the broker being away ends it.
//
// An outage is not an event's failure. When the broker takes nothing — the
// connection is down, JetStream answers "unavailable" or not at all, every
// publish of a batch timed out — the batch is handed back without counting
// an attempt, and the relay pauses (backoff up to OutageBackoffMax),
// however long the outage lasts. Only an event's own failure (no stream for its
// subject, too large, invalid headers: dead at once; any other error:
// counted towards MaxAttempts) can make it dead. While it is paused, the
// relay claims nothing until JetStream answers an API call, so that a relay
// cut off alone leaves the events to relays that can publish them.
func (r *Relay) Run(ctx context.Context) error {
	// The schema names the LISTEN channel. The database may not answer yet
	// (down, starting, out of connections): wait for it, as for everything
	// else the relay does.
	for failures := 1; ; failures++ {
		err := r.pool.QueryRow(ctx, "SELECT current_schema()").Scan(&r.schema)
		if err == nil {
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
		case <-time.After(backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, failures)):
		}
	}
	g, ctx := errgroup.WithContext(ctx)
	if !r.cfg.DisableListen {
		g.Go(func() error { r.listen(ctx); return nil })
	}
	g.Go(func() error { r.retain(ctx); return nil })
	for range r.cfg.Workers {
		g.Go(func() error { r.work(ctx); return nil })
	}
	return g.Wait()
}

func (r *Relay) work(ctx context.Context) {
	failures, outages := 0, 0
	for ctx.Err() == nil {
		n, err := r.relayBatch(ctx)
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
		if n == r.cfg.BatchSize && failures == 0 && outages == 0 {
			continue // a full batch: more are probably waiting
		}
		wait := r.cfg.PollInterval
		switch {
		case outages > 0:
			wait = backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, outages)
		case failures > 0:
			wait = backoff(r.cfg.BackoffBase, r.cfg.BackoffMax, failures)
		}
		select {
		case <-ctx.Done():
		case <-r.kick:
		case <-time.After(wait):
		}
	}
}

// relayBatch claims, publishes and marks one batch; it returns how many
// events it claimed, and an *unavailableError when the broker took none
// of them for reasons of its own.
func (r *Relay) relayBatch(ctx context.Context) (int, error) {
	if st := r.nc.Status(); st != nats.CONNECTED {
		// While the broker is unreachable every publish would fail; the
		// events wait, unclaimed, in the outbox instead.
		return 0, &unavailableError{fmt.Errorf("nats connection %s", st)}
	}
	down := r.stats.downSince.Load() != 0
	if down {
		// Ask JetStream itself before claiming anything: a relay that
		// cannot reach it (a partition of this process alone, say) must
		// leave the events to the relays that can, not hold one after
		// another for a publish timeout.
		if err := r.probe(ctx); err != nil {
			return 0, &unavailableError{err}
		}
	}
	token := uuid.New()
	batch, err := r.claim(ctx, token)
	if err != nil || len(batch) == 0 {
		if err == nil && down {
			r.brokerUp() // JetStream answers and there is nothing to send
		}
		return 0, err
	}
	// Failure window: the lease is committed, nothing is published. The
	// batch waits for the lease to expire; then any relay takes it over.
	if err := r.cfg.failpoint(FailpointAfterClaim); err != nil {
		return len(batch), err
	}
	claimed := time.Now()
	// The claim is committed. From here the batch is finished even if ctx
	// ends, so a shutdown leaves no claimed-but-unmarked rows behind.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout+r.cfg.LeaseDuration/2)
	defer cancel()
	results, err := r.publish(ctx, batch, claimed)
	if err != nil {
		return len(batch), err // "died" part way: nothing is settled, the lease expires
	}
	if err := r.settle(ctx, token, batch, results); err != nil {
		return len(batch), err
	}
	return len(batch), verdict(results)
}

// row is one claimed event.
type row struct {
	id       uuid.UUID
	aggType  string
	aggID    string
	seq      int64
	typ      string
	version  int
	subject  string
	payload  []byte
	headers  map[string]string
	occurred time.Time
	attempts int
	takeover bool // the row carried an expired lease of an earlier claim
}

// claim takes a batch in one short transaction: each row is the oldest
// unpublished event of its aggregate (so k+1 is never claimed before k is
// published), available, and not leased to anyone else. SKIP LOCKED lets
// relays claim side by side; the committed lease, not a held lock, keeps
// other relays off while this one publishes.
func (r *Relay) claim(ctx context.Context, token uuid.UUID) ([]row, error) {
	limit := r.cfg.BatchSize
	if r.stats.downSince.Load() != 0 {
		limit = 1 // the broker was taking nothing: probe with one event, not a batch of leases
	}
	rows, err := r.pool.Query(ctx, claimSQL, limit, r.cfg.Name, token, r.cfg.LeaseDuration.Microseconds())
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	batch, err := pgx.CollectRows(rows, func(rs pgx.CollectableRow) (row, error) {
		var x row
		err := rs.Scan(&x.id, &x.aggType, &x.aggID, &x.seq, &x.typ, &x.version, &x.subject, &x.payload, &x.headers, &x.occurred, &x.attempts, &x.takeover)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	for _, ev := range batch {
		if ev.takeover {
			r.stats.takenOver.Add(1)
		}
	}
	return batch, nil
}

const claimSQL = `
WITH claimable AS (
	SELECT o.event_id, o.claim_until IS NOT NULL AS takeover FROM outbox o
	WHERE o.published_at IS NULL AND o.dead_at IS NULL
	  AND o.available_at <= now()
	  AND (o.claim_until IS NULL OR o.claim_until < now())
	  AND NOT EXISTS (
	      SELECT 1 FROM outbox earlier
	      WHERE earlier.aggregate_type = o.aggregate_type
	        AND earlier.aggregate_id = o.aggregate_id
	        AND earlier.aggregate_seq < o.aggregate_seq
	        AND earlier.published_at IS NULL)
	ORDER BY o.event_id
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET claimed_by = $2, claim_token = $3, claim_until = now() + $4 * interval '1 microsecond'
FROM claimable c
WHERE o.event_id = c.event_id
RETURNING o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.event_type,
          o.schema_version, o.subject, o.payload, o.headers, o.occurred_at, o.attempts,
          c.takeover`

// result is the outcome of publishing one event.
type result struct {
	err       error // nil: acked
	permanent bool  // err will not go away by retrying
	outage    bool  // the broker took nothing: not the event's failure, no attempt counted
	duplicate bool
	latency   time.Duration // claim to ack, when acked
}

// publish sends the whole batch without waiting in between, then collects
// the acks: one round trip's latency per batch, not per event. claimed is
// when the batch's claim committed, the start of each event's latency. It
// returns an error only when a failpoint fired: the relay then abandons the
// batch as if it had died.
func (r *Relay) publish(ctx context.Context, batch []row, claimed time.Time) ([]result, error) {
	results := make([]result, len(batch))
	futures := make([]jetstream.PubAckFuture, len(batch))
	cl := &classifier{r: r, notFound: map[string]bool{}}
	for i, ev := range batch {
		// Failure window: the events before this one may be stored in the
		// stream, this one and the rest are not; none is marked. After the
		// lease, all are published again with their ids, and the stream's
		// duplicate window drops the copies it holds.
		if err := r.cfg.failpoint(FailpointBeforePublish); err != nil {
			return nil, err
		}
		msg, err := ev.message()
		if err != nil {
			results[i] = result{err: err, permanent: true}
			continue
		}
		// Nats-Msg-Id is the event id on every attempt, so the stream drops a
		// copy it already stored within its duplicate window.
		f, err := r.js.PublishMsgAsync(msg, jetstream.WithMsgID(ev.id.String()))
		if err != nil {
			results[i] = cl.classify(ctx, ev, err)
			continue
		}
		futures[i] = f
	}
	timeout := time.NewTimer(r.cfg.PublishTimeout)
	defer timeout.Stop()
	expired := false
	for i, f := range futures {
		if f == nil {
			continue
		}
		if expired {
			select {
			case ack := <-f.Ok():
				results[i] = result{duplicate: ack.Duplicate, latency: time.Since(claimed)}
			case err := <-f.Err():
				results[i] = cl.classify(ctx, batch[i], err)
			default:
				results[i] = result{err: errAckTimeout, outage: true}
			}
			continue
		}
		select {
		case ack := <-f.Ok():
			results[i] = result{duplicate: ack.Duplicate, latency: time.Since(claimed)}
		case err := <-f.Err():
			results[i] = cl.classify(ctx, batch[i], err)
		case <-timeout.C:
			// The broker may have stored it: the result is unknown, so the
			// event is retried with the same id rather than given up.
			expired = true
			results[i] = result{err: errAckTimeout, outage: true}
		case <-ctx.Done():
			expired = true
			results[i] = result{err: ctx.Err(), outage: true}
		}
	}
	return results, nil
}

var errAckTimeout = errors.New("no ack from the broker in time (result unknown)")

// message builds the NATS message with the contract's headers.
func (ev row) message() (*nats.Msg, error) {
	h := nats.Header{}
	for k, v := range ev.headers {
		h.Set(k, v)
	}
	h.Set("Event-Type", ev.typ)
	h.Set("Aggregate-Type", ev.aggType)
	h.Set("Aggregate-Id", ev.aggID)
	h.Set("Aggregate-Seq", strconv.FormatInt(ev.seq, 10))
	h.Set("Schema-Version", strconv.Itoa(ev.version))
	h.Set("Occurred-At", ev.occurred.UTC().Format(time.RFC3339Nano))
	for k, vs := range h {
		if k == "" || strings.ContainsAny(k, ": \t\r\n") {
			return nil, fmt.Errorf("invalid header name %q", k)
		}
		for _, v := range vs {
			if strings.ContainsAny(v, "\r\n") {
				return nil, fmt.Errorf("invalid value of header %q", k)
			}
		}
	}
	return &nats.Msg{Subject: ev.subject, Header: h, Data: ev.payload}, nil
}

// settle records the outcome of a batch. Every update is fenced by the
// claim token: a relay whose lease expired and was taken over matches no
// rows, so it can neither mark nor fail an event it no longer owns.
func (r *Relay) settle(ctx context.Context, token uuid.UUID, batch []row, results []result) error {
	var acked, released [][16]byte // plain arrays: pgx encodes them without the driver.Valuer detour
	var outage error
	failed := &pgx.Batch{}
	for i, res := range results {
		ev := batch[i]
		if res.err == nil {
			acked = append(acked, ev.id)
			if res.duplicate {
				r.stats.duplicates.Add(1)
			}
			if r.cfg.ObservePublishFunc != nil {
				r.cfg.ObservePublishFunc(res.latency)
			}
			continue
		}
		if res.outage {
			// The broker's failure, not the event's: handed back as it
			// was, due now, its attempts untouched.
			released = append(released, ev.id)
			outage = cmp.Or(outage, res.err)
			continue
		}
		dead := res.permanent || ev.attempts+1 >= r.cfg.MaxAttempts
		delay := backoff(r.cfg.BackoffBase, r.cfg.BackoffMax, ev.attempts+1)
		failed.Queue(failSQL, ev.id, token, res.err.Error(), delay.Microseconds(), dead).Exec(func(tag pgconnTag) error {
			switch {
			case tag.RowsAffected() == 0:
				r.stats.lostLeases.Add(1)
			case dead:
				r.stats.dead.Add(1)
				r.log.Error("outbox event dead", "event_id", ev.id, "event_type", ev.typ,
					"aggregate_id", ev.aggID, "seq", ev.seq, "attempts", ev.attempts+1, "err", res.err)
			default:
				r.stats.retried.Add(1)
				r.log.Warn("outbox event publish failed, will retry", "event_id", ev.id,
					"aggregate_id", ev.aggID, "seq", ev.seq, "attempts", ev.attempts+1, "retry_in", delay, "err", res.err)
			}
			return nil
		})
	}
	if len(acked) > 0 {
		// Failure window: the broker stored the events, the outbox does not
		// know. An error here "dies": neither the acks nor the failures are
		// recorded, the lease expires, the events are published again (the
		// duplicate window or the consumers' inbox absorbs the copies).
		if err := r.cfg.failpoint(FailpointAfterAckBeforeMark); err != nil {
			return err
		}
		// Marked only now, after the ack: a crash before this line leaves the
		// events claimed; the lease expires and they are published again.
		tag, err := r.pool.Exec(ctx, markSQL, acked, token)
		if err != nil {
			return fmt.Errorf("mark %d events published: %w", len(acked), err)
		}
		r.stats.published.Add(tag.RowsAffected())
		r.stats.lastPublish.Store(time.Now().UnixNano())
		if lost := int64(len(acked)) - tag.RowsAffected(); lost > 0 {
			r.stats.lostLeases.Add(lost)
			r.log.Warn("outbox lease lost before marking; another relay publishes these again", "events", lost)
		}
	}
	if len(released) > 0 {
		failed.Queue(releaseSQL, released, token, outage.Error()).Exec(func(tag pgconnTag) error {
			r.stats.deferred.Add(tag.RowsAffected())
			return nil
		})
	}
	if failed.Len() > 0 {
		if err := r.pool.SendBatch(ctx, failed).Close(); err != nil {
			return fmt.Errorf("record %d publish failures: %w", failed.Len(), err)
		}
	}
	return nil
}

const markSQL = `
UPDATE outbox
SET published_at = now(), claimed_by = NULL, claim_token = NULL, claim_until = NULL
WHERE event_id = ANY($1) AND claim_token = $2`

const failSQL = `
UPDATE outbox
SET attempts = attempts + 1,
    last_error = $3,
    available_at = now() + $4 * interval '1 microsecond',
    dead_at = CASE WHEN $5 THEN now() END,
    claimed_by = NULL, claim_token = NULL, claim_until = NULL
WHERE event_id = $1 AND claim_token = $2`

// releaseSQL hands events back after an outage: no attempt counted, due
// now (the relay's own pause spaces the tries), fenced like the rest.
const releaseSQL = `
UPDATE outbox
SET last_error = $3, claimed_by = NULL, claim_token = NULL, claim_until = NULL
WHERE event_id = ANY($1) AND claim_token = $2`

// backoff is exponential with full jitter: a random delay up to
// base·2^(attempt-1), capped, so relays retrying together spread out.
func backoff(base, ceiling time.Duration, attempt int) time.Duration {
	d := ceiling
	if attempt < 31 {
		d = min(ceiling, base<<(attempt-1))
	}
	return time.Duration(rand.Int64N(int64(d)) + 1)
}

// listen turns NOTIFYs on the schema's channel into kicks. It holds one
// connection of its own; if that fails, polling carries on until it is back.
func (r *Relay) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		r.log.Warn("outbox listen failed; polling until it is back", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(r.cfg.PollInterval):
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{"outbox." + r.schema}.Sanitize()); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return fmt.Errorf("wait for notification: %w", err)
		}
		r.wake()
		// Writers coalesce their NOTIFYs; a transaction that skipped its own
		// may commit just after the one that woke us. Look once more.
		time.AfterFunc(notifyFollowUp, r.wake)
	}
}

// notifyFollowUp is how long after a wake-up the relay looks again. Writer
// NotifyIntervals at or below it add no latency beyond it.
const notifyFollowUp = 25 * time.Millisecond

// retain deletes published rows past the retention window, in small batches
// so that no statement holds many locks or runs long.
func (r *Relay) retain(ctx context.Context) {
	t := time.NewTicker(r.cfg.RetentionInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := deleteExpired(ctx, r.pool, r.cfg.Retention, r.cfg.RetentionBatch, r.cfg.failpoint)
		if err != nil && ctx.Err() == nil {
			r.log.Warn("outbox retention failed", "err", err)
		} else if n > 0 {
			r.log.Debug("outbox retention deleted published events", "events", n)
		}
	}
}
