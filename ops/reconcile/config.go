package reconcile

import (
	"cmp"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
)

// Config tunes what counts as stuck. Zero fields take the defaults beside
// them.
type Config struct {
	Pending        time.Duration // PENDING longer than this is stuck; default 5m
	Paid           time.Duration // PAID or FULFILLING longer than this is stuck; default 1h
	PaymentTimeout time.Duration // the order service's PAYMENT_TIMEOUT; default 15m
	Grace          time.Duration // slack past a deadline, and age before a payment or reservation counts; default 5m
	// RepublishAfter is how long ago an event must have been published (or
	// last republished) to be republished: longer than JetStream's
	// duplicate window, or the broker would drop the copy as a duplicate,
	// and it spaces repeated repairs of one order. Default
	// broker.DuplicateWindow + 1m.
	RepublishAfter time.Duration
	// Repair republishes lost events; false only reports.
	Repair bool
	// Limit bounds the orders repaired per run; default 100. Events a
	// stream lost are all republished, one statement per service.
	Limit int
	// JetStream, when set, adds the audit of every service's stream
	// against its outbox (LostEvent findings, verify.AuditStreams); nil
	// skips it.
	JetStream jetstream.JetStream
	// Retention is the relays' outbox retention: the stream audit looks
	// for the events published within it. Required with JetStream.
	Retention time.Duration
	// AuditNewest bounds the stream audit to the newest this many
	// published events of each service, so that a run every minute costs
	// about a second however long the retention and the traffic (`shop
	// outbox republish --lost` audits all of it); default 100,000.
	AuditNewest int
}

func (c *Config) setDefaults() {
	c.Pending = cmp.Or(c.Pending, 5*time.Minute)
	c.Paid = cmp.Or(c.Paid, time.Hour)
	c.PaymentTimeout = cmp.Or(c.PaymentTimeout, 15*time.Minute)
	c.Grace = cmp.Or(c.Grace, 5*time.Minute)
	c.RepublishAfter = cmp.Or(c.RepublishAfter, broker.DuplicateWindow+time.Minute)
	c.Limit = cmp.Or(c.Limit, 100)
	c.AuditNewest = cmp.Or(c.AuditNewest, 100_000)
}
