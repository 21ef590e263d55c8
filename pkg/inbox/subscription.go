package inbox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// How the consumer pulls. A pull request lives pullExpiry; the server sends
// a heartbeat every pullHeartbeat while it waits, and two missed heartbeats
// end the subscription (jetstream.ErrNoHeartbeat). Short, so that a
// consumer leader that died, a partition or a deleted consumer is noticed
// within seconds, not the 30 s of nats.go's defaults.
const (
	pullExpiry    = 4 * time.Second
	pullHeartbeat = 1500 * time.Millisecond
)

// How long the consumer waits between two attempts to subscribe: capped
// low, because the broker coming back must not wait long for us, and
// jittered, so that many consumers do not knock in step.
const (
	resubscribeBase = 100 * time.Millisecond
	resubscribeMax  = 2 * time.Second
)

// consume subscribes and feeds the workers' queues until ctx ends, then
// hands prefetched messages back and returns nil. Whatever the broker does
// — JetStream unavailable, a leader election, quorum loss, a partition, the
// durable consumer or the stream deleted — it subscribes again with backoff
// (recreating the durable consumer), logging once when the subscription is
// lost and once when it is back. It returns an error only for a
// configuration the live stream shows to be unsafe at start-up.
func (c *Consumer) consume(ctx context.Context, queues []chan *delivery) error {
	started := false
	for attempt := 1; ; attempt++ {
		it, err := c.subscribe(ctx)
		if err == nil {
			started = true
			attempt = 0
			c.up()
			err = c.pump(ctx, it, queues)
			if ctx.Err() != nil {
				c.handBack(it)
				return nil
			}
			it.Stop()
			c.stats.resubscribes.Add(1)
		}
		if ctx.Err() != nil {
			return nil
		}
		var unsafe *unsafeWindowError
		if errors.As(err, &unsafe) && !started {
			return err
		}
		c.down(err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(rand.N(grow(resubscribeBase, resubscribeMax, attempt)) + 1):
		}
	}
}

// subscribe looks up the stream, checks its duplicate window, creates or
// updates the durable consumer (recreating it if an operator deleted it)
// and starts pulling. Each broker call is bounded, so a hung request cannot
// stall the retries.
func (c *Consumer) subscribe(ctx context.Context) (jetstream.MessagesContext, error) {
	callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := c.js.Stream(callCtx, c.cfg.Stream)
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", c.cfg.Stream, err)
	}
	if d := st.CachedInfo().Config.Duplicates; d >= c.cfg.Retention {
		return nil, &unsafeWindowError{consumer: c.cfg.Name, stream: c.cfg.Stream, duplicates: d, retention: c.cfg.Retention}
	}
	cons, err := st.CreateOrUpdateConsumer(callCtx, jetstream.ConsumerConfig{
		Durable:        c.cfg.Name,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        c.cfg.AckWait,
		FilterSubjects: c.cfg.FilterSubjects,
		// Unlimited: the consumer decides when a message is dead (inbox_failures,
		// MaxDeliver), never the server.
		MaxDeliver: -1,
		// Early messages are parked and acked, so what holds this shared
		// capacity is only what is in flight and what waits out a failed
		// handler's backoff (see Config.MaxAckPending).
		MaxAckPending: c.cfg.MaxAckPending,
	})
	if err != nil {
		return nil, fmt.Errorf("create consumer %s on %s: %w", c.cfg.Name, c.cfg.Stream, err)
	}
	// Prefetch little: a message in the client's buffer is not yet held
	// (nothing reports it in progress), and its AckWait is already running.
	// The workers' queues, which are held, take what batches need from it
	// as fast as it refills.
	it, err := cons.Messages(jetstream.PullMaxMessages(c.cfg.Workers*4),
		jetstream.PullExpiry(pullExpiry), jetstream.PullHeartbeat(pullHeartbeat))
	if err != nil {
		return nil, fmt.Errorf("consume %s: %w", c.cfg.Name, err)
	}
	return it, nil
}

// unsafeWindowError says that the live stream keeps message ids at least as
// long as the inbox keeps processed_events rows.
type unsafeWindowError struct {
	consumer, stream      string
	duplicates, retention time.Duration
}

func (e *unsafeWindowError) Error() string {
	return fmt.Sprintf("inbox %s: Retention (%s) must be longer than the duplicate window (%s) of stream %s",
		e.consumer, e.retention, e.duplicates, e.stream)
}

// pump hands each message to the worker of its aggregate until the
// subscription fails (it returns that error) or ctx ends.
func (c *Consumer) pump(ctx context.Context, it jetstream.MessagesContext, queues []chan *delivery) error {
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return fmt.Errorf("consume %s: %w", c.cfg.Name, err)
		}
		c.stats.lastDelivery.Store(time.Now().UnixNano())
		d := &delivery{msg: msg}
		d.m, d.err = decode(msg.Subject(), msg.Headers(), msg.Data())
		if d.err == nil {
			d.err = stored(msg.Headers())
		}
		// One aggregate, one worker: its events are handled in order and one
		// at a time here, while other aggregates proceed in parallel.
		key := d.m.Subject
		if d.err == nil {
			key = source(d.m.Subject) + "\x00" + d.m.AggregateID
		}
		h := fnv.New32a()
		h.Write([]byte(key))
		c.progress.hold(d)
		select {
		case queues[h.Sum32()%uint32(len(queues))] <- d:
		case <-ctx.Done():
			c.progress.release(d)
			_ = msg.Nak()
		}
	}
}

// handBack returns what was prefetched at shutdown, so that another
// instance gets it now rather than after AckWait.
func (c *Consumer) handBack(it jetstream.MessagesContext) {
	it.Drain()
	for {
		msg, err := it.Next(jetstream.NextMaxWait(time.Second))
		if err != nil {
			return
		}
		_ = msg.Nak()
	}
}

// up and down log the subscription's state changes, once each: a broker
// outage makes a consumer retry every second or two, and one line per try
// would bury everything else.
func (c *Consumer) up() {
	since := c.stats.downSince.Swap(0)
	c.stats.subscribed.Store(true)
	if since != 0 {
		c.log.Info("inbox subscription restored", "stream", c.cfg.Stream,
			"down_for", time.Since(time.Unix(0, since)).Round(time.Millisecond))
	}
}

func (c *Consumer) down(err error) {
	c.stats.subscribed.Store(false)
	if c.stats.downSince.CompareAndSwap(0, time.Now().UnixNano()) {
		c.log.Warn("inbox subscription down; subscribing again until JetStream answers", "stream", c.cfg.Stream, "err", err)
		return
	}
	c.log.Debug("inbox subscription still down", "stream", c.cfg.Stream, "err", err)
}
