package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// An outage is not an event's failure: this file tells the two apart and
// keeps the relay's state with the broker.

// unavailableError says the broker took nothing of a batch, for reasons
// of its own.
type unavailableError struct{ err error }

func (e *unavailableError) Error() string { return "broker unavailable: " + e.err.Error() }
func (e *unavailableError) Unwrap() error { return e.err }

// verdict is the broker's part in a settled batch: an *unavailableError
// when nothing was acked and at least one event met the broker's own
// failure, nil otherwise.
func verdict(results []result) error {
	var first error
	for _, res := range results {
		switch {
		case res.err == nil:
			return nil // the broker takes events
		case res.outage && first == nil:
			first = res.err
		}
	}
	if first == nil {
		return nil
	}
	return &unavailableError{first}
}

// lookupTimeout bounds the one JetStream API call the relay makes besides
// publishing. It must not take a batch's whole deadline: while JetStream
// re-elects its metadata leader the call hangs, and it used to hold the
// relay for the publish timeout plus half a lease.
const lookupTimeout = 2 * time.Second

// classifier classifies the publish failures of one batch. It asks
// JetStream at most once per batch whether "no responders" means "no
// stream for this subject" or "JetStream is away", per subject only while
// the answers say "no stream". Neither is the event's failure; the answer
// decides what the relay reports.
type classifier struct {
	r        *Relay
	away     bool            // JetStream did not answer the lookup: every later no-responder is an outage too
	notFound map[string]bool // subjects no stream takes
}

func (cl *classifier) classify(ctx context.Context, ev row, err error) result {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrMaxPayload):
		return result{err: err, permanent: true}
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		return result{err: err, permanent: true}
	case errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders):
		// No responder: either no stream takes this subject or JetStream
		// is away. Ask, briefly. Both are the broker's condition, not the
		// event's: a stream the relay publishes to exists until the broker
		// loses it (a cluster that came back empty, an operator's delete),
		// and its owner creates it again. So a missing stream is waited
		// out, uncounted, never a reason to make an event dead: that once
		// killed every event a relay claimed in the seconds an empty
		// cluster had no streams, and each needed a hand-run requeue.
		if cl.notFound[ev.subject] {
			return cl.noStream(ev, err)
		}
		if cl.away {
			return result{err: err, outage: true}
		}
		lctx, cancel := context.WithTimeout(ctx, lookupTimeout)
		_, lookupErr := cl.r.js.StreamNameBySubject(lctx, ev.subject)
		cancel()
		if errors.Is(lookupErr, jetstream.ErrStreamNotFound) {
			cl.notFound[ev.subject] = true
			return cl.noStream(ev, err)
		}
		cl.away = true
		return result{err: err, outage: true}
	case unavailable(err):
		return result{err: err, outage: true}
	}
	return result{err: err}
}

// noStream is the result of an event no stream takes: handed back
// uncounted, as in an outage. It is logged at most once per
// noStreamLogEvery, with the subject, so that an operator who deleted a
// stream, or a deployment that never created one, sees why events wait.
func (cl *classifier) noStream(ev row, err error) result {
	err = fmt.Errorf("no stream for subject %q (the event waits for it): %w", ev.subject, err)
	now := time.Now().UnixNano()
	if last := cl.r.stats.noStreamLogged.Load(); now-last > int64(noStreamLogEvery) && cl.r.stats.noStreamLogged.CompareAndSwap(last, now) {
		cl.r.log.Warn("outbox relay: no stream takes the subject; its events wait, uncounted, until the stream exists again",
			"subject", ev.subject, "event_id", ev.id)
	}
	return result{err: err, outage: true}
}

// noStreamLogEvery spaces the relay's warnings about a missing stream.
const noStreamLogEvery = 30 * time.Second

// unavailable reports whether err is the broker's own condition rather than
// anything about the event: no connection, JetStream off or without
// quorum (HTTP-like status 503), no answer in time, too much in flight.
func unavailable(err error) bool {
	var apiErr *jetstream.APIError
	switch {
	case errors.As(err, &apiErr):
		return apiErr.Code == 503
	case errors.Is(err, errAckTimeout), errors.Is(err, jetstream.ErrAsyncPublishTimeout), errors.Is(err, jetstream.ErrTooManyStalledMsgs),
		errors.Is(err, nats.ErrTimeout), errors.Is(err, nats.ErrConnectionClosed),
		errors.Is(err, nats.ErrConnectionDraining), errors.Is(err, nats.ErrConnectionReconnecting),
		errors.Is(err, nats.ErrDisconnected), errors.Is(err, nats.ErrNoServers),
		errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return true
	}
	return false
}

// probe asks JetStream whether it answers this relay at all (one API call,
// bounded). It answering is not yet proof that the event's stream takes
// publishes (its leader may still be elected), so the first claim after it
// is one event.
func (r *Relay) probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	if _, err := r.js.AccountInfo(ctx); err != nil {
		return fmt.Errorf("jetstream account info: %w", err)
	}
	return nil
}

// brokerDown and brokerUp keep the relay's state with the broker, shared by
// its workers, and log its changes once each: during an outage the relay
// tries every second or two, and one line per try would bury the rest.
func (r *Relay) brokerDown(err error) {
	if r.stats.downSince.CompareAndSwap(0, time.Now().UnixNano()) {
		r.stats.outages.Add(1)
		r.log.Warn("outbox relay: the broker takes nothing; pausing, without counting attempts, until it does", "err", err)
		return
	}
	r.log.Debug("outbox relay: the broker still takes nothing", "err", err)
}

func (r *Relay) brokerUp() {
	if since := r.stats.downSince.Swap(0); since != 0 {
		r.log.Info("outbox relay: the broker takes events again", "down_for", time.Since(time.Unix(0, since)).Round(time.Millisecond))
	}
}
