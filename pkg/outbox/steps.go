package outbox

// The relay's three steps, in the order one batch takes them: claim due
// rows under a lease (claim), publish them and wait for every ack
// (publish), then mark what was acked, fenced by the lease (settle). Run
// and relayBatch, which repeat them, are in relay.go.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
)

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
	takeover bool      // the row carried an expired lease of an earlier claim
	since    time.Time // start of its publish latency: its claim's commit, or in CDC mode its own commit
}

func (r *Relay) limit() int {
	if r.stats.downSince.Load() != 0 {
		return 1 // the broker was taking nothing: probe with one event, not a batch
	}
	return r.cfg.BatchSize
}

// query runs a claim and collects its rows.
func (r *Relay) query(ctx context.Context, sql string, args ...any) ([]row, error) {
	rows, err := r.pool.Query(ctx, sql, args...)
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
	return batch, nil
}

// claim takes a batch in one short transaction: each row is the oldest
// unpublished event of its aggregate (so k+1 is never claimed before k is
// published), available, and not leased to anyone else. SKIP LOCKED lets
// relays claim side by side; the committed lease, not a held lock, keeps
// other relays off while this one publishes.
func (r *Relay) claim(ctx context.Context, token uuid.UUID) ([]row, error) {
	batch, err := r.query(ctx, claimSQL, r.limit(), r.cfg.Name, token, r.cfg.LeaseDuration.Microseconds(), r.handOff().Microseconds(), r.cdc.backfillBefore.Load())
	if err != nil {
		return nil, err
	}
	for _, ev := range batch {
		if ev.takeover {
			r.stats.takenOver.Add(1)
		}
	}
	return batch, nil
}

// dueSQL selects the outbox rows o a relay may publish now: due ($5
// microseconds ago: in CDC mode the table's events are the stream's for
// the HandOff, except those due before $6, when the slot was made, which
// no stream carries), not
// leased by a live claim (one whose lease has not ended and whose relay is
// not known to be gone, alive.go), and the oldest unpublished event of their
// aggregate, so that k+1 is never published before k.
const dueSQL = `o.available_at <= GREATEST(now() - $5 * interval '1 microsecond', $6::timestamptz)
	  AND (o.claim_until IS NULL OR o.claim_until < now() OR ` + claimantGoneSQL + `)
	  AND NOT EXISTS (
	      SELECT 1 FROM outbox earlier
	      WHERE earlier.aggregate_type = o.aggregate_type
	        AND earlier.aggregate_id = o.aggregate_id
	        AND earlier.aggregate_seq < o.aggregate_seq
	        AND earlier.published_at IS NULL)`

const claimSQL = `
WITH claimable AS (
	SELECT o.event_id, o.claim_until IS NOT NULL AS takeover FROM outbox o
	WHERE o.published_at IS NULL AND o.dead_at IS NULL
	  AND ` + dueSQL + `
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
// the acks: one round trip's latency per batch, not per event. It
// returns an error only when a failpoint fired: the relay then abandons the
// batch as if it had died.
func (r *Relay) publish(ctx context.Context, batch []row) ([]result, error) {
	results := make([]result, len(batch))
	futures := make([]jetstream.PubAckFuture, len(batch))
	spans := make([]trace.Span, len(batch)) // nil where nothing is traced
	// answered ends event i's span with its result, as soon as it is known.
	answered := func(i int, res result) {
		results[i] = res
		endPublishSpan(spans[i], res)
		spans[i] = nil
	}
	defer func() {
		for _, span := range spans { // a failpoint abandoned the batch
			endPublishSpan(span, result{err: errAbandoned})
		}
	}()
	cl := &classifier{r: r, notFound: map[string]bool{}}
	for i, ev := range batch {
		// Failure window: the events before this one may be stored in the
		// stream, this one and the rest are not; none is marked. After the
		// lease, all are published again with their ids, and the stream's
		// duplicate window drops the copies it holds.
		if err := r.cfg.failpoint(failpointBeforePublish); err != nil {
			return nil, err
		}
		spans[i] = r.startPublishSpan(ctx, ev)
		msg, err := ev.message()
		if err != nil {
			answered(i, result{err: err, permanent: true})
			continue
		}
		carryPublishSpan(msg, spans[i])
		// Nats-Msg-Id is the event id on every attempt, so the stream drops a
		// copy it already stored within its duplicate window.
		f, err := r.js.PublishMsgAsync(msg, jetstream.WithMsgID(ev.id.String()))
		if err != nil {
			answered(i, cl.classify(ctx, ev, err))
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
				answered(i, result{duplicate: ack.Duplicate, latency: time.Since(batch[i].since)})
			case err := <-f.Err():
				answered(i, cl.classify(ctx, batch[i], err))
			default:
				answered(i, result{err: errAckTimeout, outage: true})
			}
			continue
		}
		select {
		case ack := <-f.Ok():
			answered(i, result{duplicate: ack.Duplicate, latency: time.Since(batch[i].since)})
		case err := <-f.Err():
			answered(i, cl.classify(ctx, batch[i], err))
		case <-timeout.C:
			// The broker may have stored it: the result is unknown, so the
			// event is retried with the same id rather than given up.
			expired = true
			answered(i, result{err: errAckTimeout, outage: true})
		case <-ctx.Done():
			expired = true
			answered(i, result{err: ctx.Err(), outage: true})
		}
	}
	return results, nil
}

var (
	errAckTimeout = errors.New("no ack from the broker in time (result unknown)")
	// errAbandoned ends the publish spans of a batch the relay abandoned
	// part way (a failpoint): its lease expires, and a relay publishes the
	// events again.
	errAbandoned = errors.New("batch abandoned before its acks were read")
)

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
// rows, so it can neither mark nor fail an event it no longer owns. It
// reports whether an event it marked has its aggregate's next event
// waiting, which only now may be claimed.
func (r *Relay) settle(ctx context.Context, token uuid.UUID, batch []row, results []result) (next bool, err error) {
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
			if r.cfg.Hooks.ObservePublishFunc != nil {
				r.cfg.Hooks.ObservePublishFunc(res.latency)
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
		delay := backoff(r.cfg.BackoffBase, r.cfg.BackoffMax, ev.attempts+1, r.jitter)
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
		if err := r.cfg.failpoint(failpointAfterAckBeforeMark); err != nil {
			return false, err
		}
		// Marked only now, after the ack: a crash before this line leaves the
		// events claimed; the lease expires and they are published again.
		var marked, waiting int64
		if err := r.pool.QueryRow(ctx, markSQL, acked, token).Scan(&marked, &waiting); err != nil {
			return false, fmt.Errorf("mark %d events published: %w", len(acked), err)
		}
		// Failure window: an aggregate's next event (written in the same
		// transaction, say) could not be claimed while this one was in
		// flight, and the wake-up of its commit went to a worker that found
		// nothing. Without a look now it waited for the next poll.
		next = waiting > 0
		r.stats.published.Add(marked)
		r.stats.lastPublish.Store(time.Now().UnixNano())
		if lost := int64(len(acked)) - marked; lost > 0 {
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
			return next, fmt.Errorf("record %d publish failures: %w", failed.Len(), err)
		}
	}
	return next, nil
}

const markSQL = `
WITH marked AS (
	UPDATE outbox
	SET published_at = now(), claimed_by = NULL, claim_token = NULL, claim_until = NULL
	WHERE event_id = ANY($1) AND claim_token = $2
	RETURNING aggregate_type, aggregate_id, aggregate_seq
)
SELECT count(*),
       count(*) FILTER (WHERE EXISTS (SELECT 1 FROM outbox n
           WHERE n.aggregate_type = m.aggregate_type AND n.aggregate_id = m.aggregate_id
             AND n.aggregate_seq = m.aggregate_seq + 1 AND n.published_at IS NULL AND n.dead_at IS NULL))
FROM marked m`

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
