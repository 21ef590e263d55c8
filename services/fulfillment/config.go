package fulfillment

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Config configures a [Service]. Zero fields take the default named in their
// comment.
type Config struct {
	// Delay is how long after a shipment starts the (simulated) carrier
	// delivers it: FULFILLMENT_DELAY. Default 2s.
	Delay time.Duration
	// Logger receives the service's logs; nil discards them.
	Logger *slog.Logger
	// PublishHorizon is how long after an event's first publish its
	// producer's relay may still publish a copy; the inbox keeps event ids
	// longer. internal/app passes the RetryHorizon of the relays it really
	// runs. Default: the outbox relay's default RetryHorizon.
	PublishHorizon time.Duration

	// ObserveInboxFunc, when set, observes the consumer's processing times
	// (inbox.Config.ObserveFunc). Default: none.
	ObserveInboxFunc func(consumer string, d time.Duration)
	// TracerProvider makes the spans of the service's consumer (see
	// pkg/inbox) and of its deliveries. Default: nil, no spans.
	TracerProvider trace.TracerProvider

	// FailpointFunc, when set, is handed to the service's inbox consumer
	// (inbox.Config.FailpointFunc); internal/app sets it to
	// internal/failpoint.Inject. Default: none.
	FailpointFunc func(name string) error
}

// DefaultDelay is the contract's default FULFILLMENT_DELAY.
const DefaultDelay = 2 * time.Second

func (c *Config) setDefaults() {
	if c.TracerProvider == nil {
		c.TracerProvider = noop.NewTracerProvider()
	}
	c.Delay = cmp.Or(c.Delay, DefaultDelay)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

func (c *Config) validate() error {
	if c.Delay < 0 {
		return fmt.Errorf("fulfillment: Delay (%s) must not be negative", c.Delay)
	}
	return nil
}

// pollInterval is how often the delivery scanner looks for due shipments: a
// quarter of the delay, so a delivery is late by at most that fraction, but
// no more often than every 20ms (an idle scanner costs one query per poll)
// and no less often than every 250ms (long delays need no coarse lateness).
func (c *Config) pollInterval() time.Duration {
	return max(min(c.Delay/4, 250*time.Millisecond), 20*time.Millisecond)
}
