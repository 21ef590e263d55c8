package inbox

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A stream's republish copies each message it stores under its source
// subjects to its destination, whatever the original's publisher may do: a
// user allowed to publish only to payment.> set PAYMENT up to republish
// payment.forge.> as orders.>, and ORDERS stored the copies, event headers
// and all. Every copy is dead-lettered as forged, even one whose publisher
// put a Nats-Stream header naming ORDERS ahead of the server's (the server
// refuses a publisher's Nats-Stream-Source outright), and nothing
// of them is applied: the aggregate's next sequence is still free for the
// real event, and an operator's requeue does not apply a copy either.
func TestRepublishedIntoTheStreamIsForged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t)
	cfg := e.config(t, record(""))
	run(t, e.consumer(t, e.pool, e.js, cfg))
	if _, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "PAYMENT", Subjects: []string{"payment.>"}, Storage: jetstream.FileStorage,
		RePublish: &jetstream.RePublish{Source: "payment.forge.>", Destination: "orders.>"},
	}); err != nil {
		t.Fatal(err)
	}

	e.publish(t, newEvent("a", 1))
	forge := func(ev event, header ...string) {
		t.Helper()
		m := ev.msg()
		m.Subject = "payment.forge." + ev.agg + "." + ev.typ // republished as orders.<agg>.<type>
		for i := 0; i < len(header); i += 2 {
			m.Header.Set(header[i], header[i+1])
		}
		e.publishMsg(t, m)
	}
	forge(newEvent("a", 2))                            // the next sequence of a
	forge(newEvent("b", 1), "Nats-Stream", testStream) // a new aggregate, claiming ORDERS stored it

	orders, err := e.js.Stream(ctx, testStream)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "ORDERS holds the two copies", func() bool {
		info, err := orders.Info(ctx)
		return err == nil && info.State.Msgs == 3
	})
	eventually(t, "every message is settled", func() bool { return e.settled(t) })

	wantSeqs(t, e, "a", 1)
	wantSeqs(t, e, "b")
	dead, err := ListDeadLetters(ctx, e.db.Pool, testConsumer, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 2 {
		t.Fatalf("%d dead letters, want the 2 copies: %+v", len(dead), dead)
	}
	for _, dl := range dead {
		if !strings.Contains(dl.Error, ErrForged.Error()) || !strings.Contains(dl.Error, `Nats-Stream: "PAYMENT"`) ||
			!strings.HasPrefix(dl.Subject, "orders.") || dl.Attempts != 1 {
			t.Errorf("dead letter of %s after %d attempts: %q; want it forged, naming PAYMENT", dl.Subject, dl.Attempts, dl.Error)
		}
	}
	if n := e.count(t, `SELECT count(*) FROM processed_events WHERE consumer_name = $1`, testConsumer); n != 1 {
		t.Errorf("processed_events: %d rows, want the real event's only", n)
	}

	t.Run("an operator's requeue applies nothing", func(t *testing.T) {
		for _, dl := range dead {
			if err := RequeueDeadLetter(ctx, e.db.Pool, dl.ID); err != nil {
				t.Fatal(err)
			}
		}
		eventually(t, "the requeued copies are dead again", func() bool {
			return e.count(t, `SELECT count(*) FROM dead_letters WHERE consumer_name = $1 AND requeued_at IS NULL
				AND resolved_at IS NULL AND attempts = 2 AND error LIKE '%forged%'`, testConsumer) == 2
		})
		wantSeqs(t, e, "a", 1)
		wantSeqs(t, e, "b")
	})

	t.Run("the real next event applies", func(t *testing.T) {
		e.publish(t, newEvent("a", 2))
		eventually(t, "a's second event applied", func() bool { return len(e.seqs(t, "a")) == 2 })
		wantSeqs(t, e, "a", 1, 2)
	})
}

func TestStored(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		h      nats.Header
		forged bool
	}{
		"as the relay publishes":    {nats.Header{"Event-Type": {"OrderCreated"}}, false},
		"republished":               {nats.Header{"Nats-Stream": {"PAYMENT"}, "Nats-Subject": {"payment.forge.a.X"}}, true},
		"republished, claimed ours": {nats.Header{"Nats-Stream": {"ORDERS", "PAYMENT"}}, true},
		"sourced":                   {nats.Header{"Nats-Stream-Source": {"PAYMENT 7"}}, true},
		"no headers":                {nil, false},
	} {
		err := stored(tc.h)
		if got := errors.Is(err, ErrForged) && errors.Is(err, ErrPoison); got != tc.forged {
			t.Errorf("%s: stored = %v, want forged %v", name, err, tc.forged)
		}
	}
}
