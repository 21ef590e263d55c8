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
	// inbox tables; instances sharing it share the work. Required; no
	// whitespace, '.', '*', '>' or '/'.
	Name string
	// Stream is the JetStream stream to consume. Required.
	Stream string
	// FilterSubjects narrows the stream (by producer, never by event type:
	// see the package doc); default: all of it.
	FilterSubjects []string
	// Handler applies the events, a batch at a time ([Each] adapts one
	// that takes an event at a time). Required.
	Handler HandlerFunc
	// Handles lists the event types Handler applies; the others are only
	// recorded, for the sequence check. Default: every type.
	Handles []string
	// Workers is how many aggregates are handled at once. Default 8. The
	// pool needs at least Workers+2 connections.
	Workers int
	// BatchSize is how many waiting deliveries a worker may apply in one
	// transaction (never waiting for more). 1 turns batching off. Default 64.
	BatchSize int
	// MaxDeliver is how many times a handler may fail on an event before it
	// is dead-lettered. Default 10.
	MaxDeliver int
	// MaxAckPending is how many messages the durable consumer may hold
	// unacknowledged across its instances (parked ones are acked). Default
	// 4096.
	MaxAckPending int
	// BackoffBase and BackoffMax bound the jittered exponential delay
	// before a failed event's next try. Defaults 200ms and 30s.
	BackoffBase, BackoffMax time.Duration
	// AckWait is how long a dead process's deliveries wait to be
	// redelivered. Default 5s.
	AckWait time.Duration
	// HandlerTimeout is the time limit of one handler transaction (and of a
	// requeued dead letter's). Default 30s.
	HandlerTimeout time.Duration
	// Retention is how long event ids are remembered: longer than any copy
	// can come (the producer's RetryHorizon, the stream's duplicate window,
	// which Run checks, a replay). Default 14 days.
	Retention time.Duration
	// SkipSequenceCheck turns per-aggregate ordering off: events are only
	// deduplicated by id.
	SkipSequenceCheck bool
	// Logger receives the consumer's logs; default slog.Default().
	Logger *slog.Logger
	// TracerProvider makes a span for each delivery applied. Default: nil,
	// no spans.
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
