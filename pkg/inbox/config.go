package inbox

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Config configures a [Consumer]. Zero fields take the default named in
// their comment.
type Config struct {
	// Name is the durable JetStream consumer and the consumer_name in the
	// inbox tables. Instances that share a Name share the work and the
	// idempotency records. Required; no whitespace, '.', '*', '>' or '/'.
	Name string
	// Stream is the JetStream stream to consume. Required.
	Stream string
	// FilterSubjects narrows the stream; default: all of it. With the
	// sequence check on, a filter must keep every event of an aggregate
	// (filter by producer, never by event type), or the first skipped
	// sequence would hold the aggregate back for ever.
	FilterSubjects []string
	// Handler applies the events, a batch at a time (a lone delivery is a
	// batch of one; see [HandlerFunc], and [Each] for a handler that takes
	// one event at a time). Required.
	Handler HandlerFunc
	// Handles lists the event types Handler applies. An event of any other
	// type is only recorded (its cursor advanced, its processed_events row
	// inserted), without calling Handler, in no transaction of its own: by
	// one statement that commits alone, or, in a batch, with the batch's
	// record statements: a consumer reads every event of an aggregate for the
	// sequence check, and most of them are often of no interest to it.
	// Default: every type goes to Handler.
	Handles []string
	// Workers is how many events are handled at once; events of one
	// aggregate go to the same worker, one at a time. Default 8. The pool
	// needs at least Workers+2 connections.
	Workers int
	// BatchSize is how many deliveries a worker may apply in one
	// transaction: those already waiting for it, never waiting for more
	// (see the package documentation). 1 turns batching off. Default 64.
	// A batch holds every lock its handler takes until it commits: a
	// handler that locks rows shared across aggregates (stock per SKU, say)
	// one event at a time, each in an order of its own, deadlocks with other
	// workers' batches, and each deadlock redoes the batch one delivery at a
	// time. Such a handler takes all of a batch's shared locks in one
	// statement, in one global order (see [HandlerFunc]).
	BatchSize int
	// MaxDeliver is how many times a handler may fail on an event before it
	// is dead-lettered. Waiting for a sequence gap does not count. Default 10.
	MaxDeliver int
	// MaxAckPending is how many messages the durable consumer may hold
	// unacknowledged across all its instances; when reached, JetStream
	// delivers nothing more. Parked messages are acked and hold none; each
	// instance's prefetch (Workers × max(4, BatchSize), and its client's
	// buffer) and the deliveries waiting out a backoff do. Default 4096.
	MaxAckPending int
	// BackoffBase and BackoffMax shape the redelivery delay after a handler
	// failure: exponential from BackoffBase, capped at BackoffMax, with full
	// jitter. Defaults 200ms and 30s.
	BackoffBase, BackoffMax time.Duration
	// AckWait is how long the deliveries of a process that died wait to be
	// redelivered; a live process reports what it holds in progress every
	// AckWait/3. Default 5s.
	AckWait time.Duration
	// HandlerTimeout is the time limit of one handler transaction (and of a
	// requeued dead letter's). Default 30s.
	HandlerTimeout time.Duration
	// Retention is how long event ids are remembered. It must outlast every
	// copy: the producer's retries (outbox.Config.RetryHorizon), the
	// stream's duplicate window (Run checks it) and any replay. Default 14
	// days.
	Retention time.Duration
	// SkipSequenceCheck turns off per-aggregate ordering: events are then
	// deduplicated by id only and applied in whatever order they arrive.
	SkipSequenceCheck bool
	// Logger receives the consumer's logs; default slog.Default().
	Logger *slog.Logger
	// TracerProvider makes a span for each delivery applied (see Traces in
	// the package documentation). Default: nil, no spans.
	TracerProvider trace.TracerProvider
	// Hooks observe the consumer, and inject failures in tests.
	Hooks Hooks
}

const day = 24 * time.Hour

func (c *Config) setDefaults() {
	c.Workers = cmp.Or(c.Workers, 8)
	c.BatchSize = cmp.Or(c.BatchSize, 64)
	c.MaxDeliver = cmp.Or(c.MaxDeliver, 10)
	c.MaxAckPending = cmp.Or(c.MaxAckPending, 4096)
	c.BackoffBase = cmp.Or(c.BackoffBase, 200*time.Millisecond)
	c.BackoffMax = cmp.Or(c.BackoffMax, 30*time.Second)
	c.AckWait = cmp.Or(c.AckWait, 5*time.Second)
	c.HandlerTimeout = cmp.Or(c.HandlerTimeout, 30*time.Second)
	c.Retention = cmp.Or(c.Retention, 14*day)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = noop.NewTracerProvider()
	}
}

func (c *Config) validate() error {
	switch {
	case c.Name == "":
		return errors.New("inbox: Config.Name is required")
	case strings.ContainsAny(c.Name, " \t\r\n.*>/\\"):
		return fmt.Errorf("inbox: Config.Name %q is not a valid durable name", c.Name)
	case c.Stream == "":
		return errors.New("inbox: Config.Stream is required")
	case c.Handler == nil:
		return errors.New("inbox: Config.Handler is required")
	case c.Workers < 1 || c.MaxDeliver < 1 || c.BatchSize < 1:
		return fmt.Errorf("inbox: Workers (%d), BatchSize (%d) and MaxDeliver (%d) must be positive", c.Workers, c.BatchSize, c.MaxDeliver)
	case c.MaxAckPending < c.Workers*max(4, c.BatchSize):
		return fmt.Errorf("inbox: MaxAckPending (%d) must hold at least one instance's prefetch (Workers × max(4, BatchSize) = %d)",
			c.MaxAckPending, c.Workers*max(4, c.BatchSize))
	case c.BackoffBase <= 0 || c.BackoffMax < c.BackoffBase || c.AckWait <= 0 || c.HandlerTimeout <= 0 || c.Retention <= 0:
		return fmt.Errorf("inbox: need 0 < BackoffBase (%s) <= BackoffMax (%s), and positive AckWait (%s), HandlerTimeout (%s), Retention (%s)",
			c.BackoffBase, c.BackoffMax, c.AckWait, c.HandlerTimeout, c.Retention)
	}
	return nil
}
