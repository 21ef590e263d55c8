package fulfillment

import (
	"cmp"
	"fmt"
	"time"
)

// Config is the fulfillment service's own settings (its Registration
// declares their variables). Zero fields take the default named in their
// comment.
type Config struct {
	// Delay is how long after a shipment starts the (simulated) carrier
	// delivers it: FULFILLMENT_DELAY. Default 2s.
	Delay time.Duration
}

// DefaultDelay is the contract's default FULFILLMENT_DELAY.
const DefaultDelay = 2 * time.Second

func (c *Config) setDefaults() {
	c.Delay = cmp.Or(c.Delay, DefaultDelay)
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
