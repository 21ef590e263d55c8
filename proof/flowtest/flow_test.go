// Package flowtest runs the outbox and the inbox together, the way two
// services use them: events committed in one schema, relayed through a real
// JetStream server, applied in another schema.
package flowtest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/inboxtest"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

var quiet = slog.New(slog.DiscardHandler)

// consumerSide is a consuming service's schema with an effects table: one row
// per applied event, in the order they were applied.
func consumerSide(t *testing.T) *pgtest.Schema {
	t.Helper()
	s := pgtest.New(t)
	_, err := s.Pool.Exec(context.Background(), `CREATE TABLE effects (
		applied    bigint GENERATED ALWAYS AS IDENTITY,
		aggregate  text   NOT NULL,
		seq        bigint NOT NULL,
		event_id   uuid   NOT NULL)`)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func recordEffect(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (aggregate, seq, event_id) VALUES ($1, $2, $3)`,
		m.AggregateID, m.Seq, m.EventID)
	return err
}

func run(t *testing.T, what string, f func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("%s: %v", what, err)
		}
	})
}

func scalar(t *testing.T, pool *pgxpool.Pool, sql string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// published reports whether the outbox has marked the event published.
func published(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) bool {
	t.Helper()
	rec, err := outbox.Get(context.Background(), pool, id)
	if err != nil {
		t.Fatal(err)
	}
	return rec.PublishedAt != nil
}

// checkEffects fails unless every one of want events was applied exactly
// once and each aggregate's events were applied in sequence order.
func checkEffects(t *testing.T, pool *pgxpool.Pool, want int) {
	t.Helper()
	if n := scalar(t, pool, `SELECT count(*) FROM effects`); n != want {
		t.Errorf("%d effects applied, want %d", n, want)
	}
	if n := scalar(t, pool, `SELECT count(DISTINCT event_id) FROM effects`); n != want {
		t.Errorf("%d distinct events applied, want %d", n, want)
	}
	outOfOrder := scalar(t, pool, `
		SELECT count(*) FROM (
			SELECT seq, row_number() OVER (PARTITION BY aggregate ORDER BY applied) AS position
			FROM effects) e
		WHERE seq <> position`)
	if outOfOrder != 0 {
		t.Errorf("%d effects applied out of sequence order", outOfOrder)
	}
}

// evAccess is what the tests' producer and consumer may do on NATS, as a
// shop service may (broker.Permissions): publish to ev.>, its stream EV, its
// durable "effects". The relay and the inbox need nothing more.
var evAccess = broker.Access{User: "ev", Stream: "EV", Subjects: []string{"ev.>"},
	Durables: []broker.Durable{{Stream: "EV", Name: "effects"}}}

// TestManyRelaysAndConsumers: 4 relays and 4 consumer instances, 20,000
// events over 1,000 aggregates, written while everything runs. Every event
// is delivered, every aggregate in order, every effect once.
func TestManyRelaysAndConsumers(t *testing.T) {
	t.Parallel()
	const aggregates, perAggregate, instances = 1000, 20, 4
	producer := pgtest.New(t)
	consumer := consumerSide(t)
	srv, _ := natstest.NewSecuredFor(t, []broker.Access{evAccess})
	_, admin := srv.Connect(t) // a service's user may create no stream; in the shop, the keeper does
	srv.Stream(t, admin, "EV", "ev.>")

	var consumers []*inbox.Consumer
	for i := range instances {
		_, js := srv.ConnectAs(t, evAccess.User) // a connection per "process", with a service's permissions only
		relay, err := outbox.NewRelay(producer.NewPool(t, 3), js, outbox.Config{
			Name: fmt.Sprint("relay-", i), PollInterval: 100 * time.Millisecond, Logger: quiet,
		})
		if err != nil {
			t.Fatal(err)
		}
		run(t, "relay", relay.Run)
		c, err := inbox.NewConsumer(consumer.NewPool(t, 6), js, inbox.Config{
			Name: "effects", Stream: "EV", Handler: inbox.Each(recordEffect), Workers: 4,
			Logger: quiet,
		})
		if err != nil {
			t.Fatal(err)
		}
		run(t, "consumer", c.Run)
		consumers = append(consumers, c)
	}

	var writers sync.WaitGroup
	var w outbox.Writer
	for g := range 8 {
		writers.Go(func() {
			for seq := range perAggregate {
				for a := g; a < aggregates; a += 8 {
					agg := fmt.Sprintf("o-%04d", a)
					err := pgx.BeginFunc(context.Background(), producer.Pool, func(tx pgx.Tx) error {
						return w.Add(context.Background(), tx, outbox.Event{
							AggregateType: "order", AggregateID: agg, Type: "Step",
							Subject: "ev." + agg + ".Step", Payload: map[string]int{"step": seq + 1},
						})
					})
					if err != nil {
						t.Error(err)
						return
					}
				}
			}
		})
	}
	writers.Wait()

	total := aggregates * perAggregate
	poll.Until(t, 3*time.Minute, "every event applied", func() bool {
		return scalar(t, consumer.Pool, `SELECT count(*) FROM effects`) >= total
	})
	// A consumer may apply an event before its relay has collected the rest
	// of the batch's acks and marked it; marking follows shortly.
	poll.Until(t, 30*time.Second, "every event marked published", func() bool {
		st, err := outbox.ReadStats(context.Background(), producer.Pool)
		return err == nil && st.Pending == 0 && st.Dead == 0
	})
	// Every event is published and nothing is left for the consumers to
	// settle: no stray copy can still land, so the count is final.
	poll.Until(t, 30*time.Second, "the consumers to settle every message", func() bool {
		lag, err := consumers[0].Lag(context.Background())
		return err == nil && lag == 0
	})
	checkEffects(t, consumer.Pool, total)
}

// TestRepublishAfterDuplicateWindowIsAbsorbed: the relay crashes after the
// PubAck and before marking, and its successor republishes after the
// stream's duplicate window has passed, so the broker stores a second copy.
// The consumer's inbox recognises it: the effect happens once.
func TestRepublishAfterDuplicateWindowIsAbsorbed(t *testing.T) {
	t.Parallel()
	producer := pgtest.New(t)
	consumer := consumerSide(t)
	srv, _ := natstest.NewSecuredFor(t, []broker.Access{evAccess})
	_, js := srv.ConnectAs(t, evAccess.User)
	_, admin := srv.Connect(t) // a service's user may create no stream; in the shop, the keeper does
	stream, err := admin.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "EV", Subjects: []string{"ev.>"}, Duplicates: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	var w outbox.Writer
	err = pgx.BeginFunc(context.Background(), producer.Pool, func(tx pgx.Tx) error {
		return w.Add(context.Background(), tx, outbox.Event{
			AggregateType: "order", AggregateID: "o-1", Type: "OrderCreated",
			Subject: "ev.o-1.OrderCreated", Payload: map[string]string{"order_id": "o-1"},
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	id := outboxtest.RequireWritten(t, producer.Pool, outboxtest.Want{AggregateID: "o-1"}).EventID
	// The first relay published and died before marking: the broker has the
	// event, the outbox still says pending.
	if _, err := js.Publish(context.Background(), "ev.o-1.OrderCreated", []byte(`{"order_id":"o-1"}`),
		jetstream.WithMsgID(id.String())); err != nil {
		t.Fatal(err)
	}
	rec, _ := outbox.Get(context.Background(), producer.Pool, id)
	if rec.PublishedAt != nil {
		t.Fatal("setup: event already marked")
	}
	time.Sleep(200 * time.Millisecond) // past the duplicate window

	c, err := inbox.NewConsumer(consumer.Pool, js, inbox.Config{
		Name: "effects", Stream: "EV", Handler: inbox.Each(recordEffect), Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "consumer", c.Run)
	relay, err := outbox.NewRelay(producer.Pool, js, outbox.Config{PollInterval: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "relay", relay.Run)

	poll.Until(t, 10*time.Second, "the second copy stored and marked", func() bool {
		info, err := stream.Info(context.Background())
		return err == nil && info.State.Msgs == 2 &&
			published(t, producer.Pool, id)
	})
	poll.Until(t, 10*time.Second, "both copies consumed", func() bool {
		return len(inboxtest.Processed(t, consumer.Pool, "effects")) == 1 &&
			inboxtest.LastSeq(t, consumer.Pool, "effects", "ev", "order", "o-1") == 1
	})
	// The second copy is handled as a duplicate; wait until the consumer has
	// acked everything it was given, then count effects.
	poll.Until(t, 10*time.Second, "consumer caught up", func() bool {
		cons, err := stream.Consumer(context.Background(), "effects")
		if err != nil {
			return false
		}
		info, err := cons.Info(context.Background())
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0
	})
	checkEffects(t, consumer.Pool, 1)
}

// TestRelayAfterAckBeforeMarkAppliedOnce runs the relay into a consumer
// through the relay's own failpoint, in both relay modes: the relay "dies"
// after the broker acked an event and before marking it. The stream's
// duplicate window is shorter than the wait before the relay publishes the
// event again (the poller's lease; the CDC stream's restart from the
// slot's confirmed position), so the second publish is stored as a second
// message. The inbox applies the event once.
func TestRelayAfterAckBeforeMarkAppliedOnce(t *testing.T) {
	t.Parallel()
	for _, mode := range []outbox.Mode{outbox.ModePoll, outbox.ModeCDC} {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			relayAfterAckBeforeMark(t, mode)
		})
	}
}

func relayAfterAckBeforeMark(t *testing.T, mode outbox.Mode) {
	const window = 100 * time.Millisecond
	producer := pgtest.New(t)
	consumer := consumerSide(t)
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	stream, err := js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "EV", Subjects: []string{"ev.>"}, Duplicates: window,
	})
	if err != nil {
		t.Fatal(err)
	}
	c, err := inbox.NewConsumer(consumer.Pool, js, inbox.Config{
		Name: "effects", Stream: "EV", Handler: inbox.Each(recordEffect), Logger: quiet,
		AckWait: 5 * time.Second, BackoffBase: 10 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "consumer", c.Run)

	if mode == outbox.ModeCDC {
		// Registered before the relay runs, so it runs after the relay
		// stopped: a slot left behind would keep WAL for good.
		var database, schema string
		if err := producer.Pool.QueryRow(context.Background(), `SELECT current_database(), current_schema()`).Scan(&database, &schema); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := outbox.DropSlot(context.Background(), producer.Pool, outbox.SlotName(database, schema)); err != nil {
				t.Error(err)
			}
		})
	}
	var hits atomic.Int32
	relay, err := outbox.NewRelay(producer.Pool, js, outbox.Config{
		Mode:          mode,
		LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		PollInterval: 20 * time.Millisecond, BackoffBase: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond,
		Hooks: outbox.Hooks{FailpointFunc: func(name string) error {
			if name == "outbox.after_ack_before_mark" && hits.Add(1) == 1 {
				if mode == outbox.ModeCDC {
					// The CDC stream starts again within a backoff of
					// BackoffBase, inside the window, where JetStream
					// would drop the copy as a duplicate: the "crash"
					// outlasts the window (a span of time is the
					// condition), so the copy is stored, as after a
					// real relay's restart.
					time.Sleep(3 * window)
				}
				return errors.New("injected")
			}
			return nil
		}},
		Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "relay", relay.Run)
	if mode == outbox.ModeCDC {
		// The event must come through the slot, not the table's poller.
		poll.Until(t, 20*time.Second, "the relay streams its slot", func() bool { return relay.State().Streaming })
	}

	var w outbox.Writer
	if err := pgx.BeginFunc(context.Background(), producer.Pool, func(tx pgx.Tx) error {
		return w.Add(context.Background(), tx, outbox.Event{
			AggregateType: "order", AggregateID: "o-1", Type: "OrderCreated",
			Subject: "ev.o-1.OrderCreated", Payload: map[string]string{"order_id": "o-1"},
		})
	}); err != nil {
		t.Fatal(err)
	}

	poll.Until(t, 10*time.Second, "the relay marks the event after its retry", func() bool {
		return published(t, producer.Pool, outboxtest.RequireWritten(t, producer.Pool, outboxtest.Want{AggregateID: "o-1"}).EventID)
	})
	poll.Until(t, 10*time.Second, "both copies consumed", func() bool {
		got := c.Counters()
		return got.Processed+got.Duplicates == 2
	})
	checkEffects(t, consumer.Pool, 1)
	info, err := stream.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if hits.Load() != 2 || info.State.Msgs != 2 {
		t.Fatalf("failpoint hit %d times, stream holds %d messages; want 2 and 2 (the copy stored)", hits.Load(), info.State.Msgs)
	}
	if got := c.Counters(); got.Processed != 1 || got.Duplicates != 1 {
		t.Fatalf("counters %+v: want the effect once and the copy absorbed", got)
	}
}
