package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// JetStream switched off while core NATS stays up: the connection is
// CONNECTED, so only the publishes' answers tell the relay. Backoffs are
// milliseconds and MaxAttempts is 2, so that the relay tries hundreds of
// times more than MaxAttempts would allow if the outage counted: a
// 30-minute outage at the default 2 s pause is a few hundred tries too.
// Not one event may die of it, and none may have an attempt counted: the
// first batch is handed back uncounted, and after it the relay claims
// nothing until JetStream answers. In ModeCDC the stream pauses with its
// batch queued and unconfirmed, probing as often; its HandOff is an hour,
// so that the stream alone publishes, before the outage and after it.
func TestJetStreamOutageBurnsNoAttempts(t *testing.T) {
	forEachMode(t, testJetStreamOutageBurnsNoAttempts)
}

func testJetStreamOutageBurnsNoAttempts(t *testing.T, mode Mode) {
	e := setup(t)
	r := e.run(t, mode, Config{PollInterval: 10 * time.Millisecond, MaxAttempts: 2, PublishTimeout: 200 * time.Millisecond,
		BackoffBase: time.Millisecond, BackoffMax: 5 * time.Millisecond, OutageBackoffMax: 5 * time.Millisecond, HandOff: time.Hour})
	var w Writer
	add(t, e.db.Pool, &w, event("o-0", "Before"))
	eventually(t, 10*time.Second, "the first event is published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 1, nil
	})

	e.nats.DisableJetStream()
	for i := range 60 {
		add(t, e.db.Pool, &w, event(fmt.Sprintf("o-%d", i%12), "During"))
	}
	if mode == ModePoll { // the stream keeps its batch, unconfirmed: nothing to hand back
		eventually(t, 30*time.Second, "the relay to hand a batch back", func() (bool, error) {
			return r.Counters().Deferred >= 1, nil
		})
	}
	// Paused, the relay asks JetStream before every claim (at most 5ms
	// apart here): two seconds of outage are hundreds of tries.
	eventually(t, 30*time.Second, "two seconds of outage", func() (bool, error) {
		since := r.State().UnavailableSince
		return !since.IsZero() && time.Since(since) > 2*time.Second, nil
	})
	if n := count(t, e.db.Pool, "dead_at IS NOT NULL OR attempts > 0"); n != 0 {
		t.Fatalf("%d events dead or with attempts counted during the outage", n)
	}
	if r.State().UnavailableSince.IsZero() || r.Counters().Outages != 1 {
		t.Fatalf("state %+v, counters %+v: want one outage, still on", r.State(), r.Counters())
	}

	e.nats.Restart() // JetStream comes back with the server
	eventually(t, 30*time.Second, "the backlog is published once JetStream is back", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 61, nil
	})
	if n := count(t, e.db.Pool, "dead_at IS NOT NULL OR attempts > 0"); n != 0 {
		t.Fatalf("%d events dead or with attempts counted after the outage", n)
	}
	eventually(t, 10*time.Second, "the relay reports the broker back", func() (bool, error) {
		return r.State().UnavailableSince.IsZero() && !r.State().LastPublish.IsZero(), nil
	})
	if got := streamMsgs(t, e.stream); got != 61 {
		t.Fatalf("stream holds %d messages, want 61", got)
	}
}

// An idle relay that saw an outage asks JetStream itself whether it is
// back, rather than reporting the outage until its next event.
func TestIdleRelayNoticesTheBrokerIsBack(t *testing.T) {
	forEachMode(t, testIdleRelayNoticesTheBrokerIsBack)
}

func testIdleRelayNoticesTheBrokerIsBack(t *testing.T, mode Mode) {
	e := setup(t)
	r := e.run(t, mode, Config{PollInterval: 10 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		BackoffBase: time.Millisecond, OutageBackoffMax: 5 * time.Millisecond})
	e.nats.DisableJetStream()
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "During"))
	eventually(t, 10*time.Second, "the relay sees the outage", func() (bool, error) {
		return !r.State().UnavailableSince.IsZero(), nil
	})
	e.nats.Restart() // JetStream comes back with the server
	eventually(t, 10*time.Second, "published and back", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 1 && r.State().UnavailableSince.IsZero(), nil
	})
}

// errTransient is an event's own failure that retrying may cure.
var errTransient = errors.New("a transient failure of the event's own")

func TestOutageResultsAreHandedBackUncounted(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-2", "OrderCreated"))
	ctx := context.Background()
	r := e.relay(t, Config{BackoffBase: time.Hour, BackoffMax: 10 * time.Hour, OutageBackoffMax: time.Hour})
	r.jitter = longestJitter // "available_at > now()" must not hang on a draw
	token := [16]byte{1}
	batch, err := r.claim(ctx, token)
	if err != nil || len(batch) != 2 {
		t.Fatalf("claim %d rows, %v", len(batch), err)
	}
	if _, err := r.settle(ctx, token, batch, []result{{err: errAckTimeout, outage: true}, {err: errTransient}}); err != nil {
		t.Fatal(err)
	}
	if n := count(t, e.db.Pool, "attempts = 0 AND claim_token IS NULL AND available_at <= now() AND last_error = $1", errAckTimeout.Error()); n != 1 {
		t.Fatalf("%d events handed back unattempted and due now, want 1", n)
	}
	if n := count(t, e.db.Pool, "attempts = 1 AND available_at > now()"); n != 1 {
		t.Fatalf("%d events with an attempt counted and a backoff, want 1", n)
	}
	if c := r.Counters(); c.Deferred != 1 || c.Retried != 1 {
		t.Fatalf("counters %+v, want 1 deferred and 1 retried", c)
	}
}

func TestClassifyTellsTheBrokersFailuresFromTheEvents(t *testing.T) {
	outage := []error{
		errAckTimeout,
		jetstream.ErrAsyncPublishTimeout,
		jetstream.ErrTooManyStalledMsgs,
		nats.ErrConnectionClosed,
		nats.ErrTimeout,
		context.DeadlineExceeded,
		&jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"},
		jetstream.ErrJetStreamNotEnabled,
		fmt.Errorf("wrapped: %w", nats.ErrDisconnected),
	}
	for _, err := range outage {
		if !unavailable(err) {
			t.Errorf("%v: not an outage", err)
		}
	}
	for _, err := range []error{
		errors.New("something else"),
		&jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence, Description: "wrong last sequence"},
		nats.ErrMaxPayload,
	} {
		if unavailable(err) {
			t.Errorf("%v: classified as an outage", err)
		}
	}
	results := []result{{err: errors.New("x")}, {err: errAckTimeout, outage: true}}
	if verdict(results) == nil {
		t.Error("a batch with no ack and an outage is not an outage")
	}
	if verdict(append(results, result{})) != nil {
		t.Error("a batch with an ack is an outage")
	}
	if verdict([]result{{err: errors.New("x"), permanent: true}}) != nil {
		t.Error("a batch of the events' own failures is an outage")
	}
}

// A stream that is full (its byte bound reached, new messages refused) is
// the broker's condition too: the relay waits without counting attempts,
// and publishes once there is room again. In ModeCDC the stream leaves
// the events the full stream refused (while it took others) to the table,
// uncounted, where the poller hands them back as in ModePoll.
func TestFullStreamPausesTheRelay(t *testing.T) { forEachMode(t, testFullStreamPausesTheRelay) }

func testFullStreamPausesTheRelay(t *testing.T, mode Mode) {
	e := setup(t)
	ctx := context.Background()
	if _, err := e.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "TINY", Subjects: []string{"tiny.>"},
		MaxBytes: 2048, Discard: jetstream.DiscardNew}); err != nil {
		t.Fatal(err)
	}
	r := e.run(t, mode, Config{PollInterval: 10 * time.Millisecond, MaxAttempts: 2, BackoffBase: time.Millisecond,
		BackoffMax: 5 * time.Millisecond, OutageBackoffMax: 5 * time.Millisecond})
	var w Writer
	for i := range 20 {
		ev := event(fmt.Sprint("o-", i), "Big")
		ev.Subject = fmt.Sprintf("tiny.o-%d.Big", i)
		ev.Payload = map[string]string{"blob": strings.Repeat("x", 400)}
		add(t, e.db.Pool, &w, ev)
	}
	eventually(t, 30*time.Second, "the relay to stop at the full stream", func() (bool, error) {
		return !r.State().UnavailableSince.IsZero() && r.Counters().Deferred >= 1, nil
	})
	if n := count(t, e.db.Pool, "dead_at IS NOT NULL OR attempts > 0"); n != 0 {
		t.Fatalf("%d events dead or with attempts counted at a full stream", n)
	}
	// An operator makes room.
	if _, err := e.js.UpdateStream(ctx, jetstream.StreamConfig{Name: "TINY", Subjects: []string{"tiny.>"},
		MaxBytes: 1 << 20, Discard: jetstream.DiscardNew}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 20, nil
	})
}
