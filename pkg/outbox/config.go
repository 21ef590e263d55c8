package outbox

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// Config configures a Relay. Zero fields take the defaults named beside them.
type Config struct {
	Name           string        // relay id stored in claimed_by; default host-pid-random
	BatchSize      int           // events claimed per batch; default 500
	Workers        int           // claim-publish-mark loops per relay, overlapping their round trips; default 2
	PollInterval   time.Duration // fallback when no NOTIFY arrives; default 1s
	LeaseDuration  time.Duration // how long a claim lasts; default 15s
	PublishTimeout time.Duration // wait for a batch's acks; default 3s or LeaseDuration/3, whichever is shorter; NewRelay refuses more than LeaseDuration/2
	BackoffBase    time.Duration // first retry delay after a transient failure; default 250ms
	BackoffMax     time.Duration // cap of the exponential backoff; default 30s
	MaxAttempts    int           // failures of an event's own before it is dead; default 10

	OutageBackoffMax time.Duration // cap of the pause while the broker takes nothing (see Relay.Run); default 2s

	Retention         time.Duration // published rows older than this are deleted; default 72h
	RetentionInterval time.Duration // how often to delete; default 1m
	RetentionBatch    int           // rows per delete statement; default 1000

	Logger *slog.Logger // default slog.Default(), as in pkg/inbox and pkg/saga

	// Mode is ModePoll (the default) or ModeCDC. In ModeCDC the relay
	// streams the outbox's inserts from a logical replication slot; the
	// database must run with wal_level=logical, and the relay's role may
	// replicate and owns the outbox table (it creates the slot and the
	// publication). Where that cannot be, the relay says why, in its log
	// and State, and polls as in ModePoll until it can.
	Mode Mode
	// Slot names the replication slot and publication of ModeCDC; default
	// SlotName of the pool's database and schema.
	Slot string
	// HandOff, in ModeCDC, keeps the relay's poller off the events the
	// stream may still publish: the poller takes an unpublished event
	// only once it has waited this long. Events the stream left to the
	// table (its aggregate's previous event unpublished, its own failure)
	// and events committed before this relay made the slot are due to the
	// poller at once. A requeued or republished event waits the HandOff:
	// it is an update, which the stream never carries. Default 10s.
	HandOff time.Duration
	// SlotDropHint, in ModePoll, is how an operator drops the relay's slot
	// left from ModeCDC (say "shop slots drop --service order"), named in
	// the warning the relay logs while that slot exists. Default: a call
	// of DropSlot.
	SlotDropHint string

	// TracerProvider, when set, makes each traced event's publish a
	// producer span "publish <type>", a child of the writer's span, ended
	// at the PubAck; the message then carries its traceparent. Default
	// nil: no spans, the message carries the writer's traceparent.
	TracerProvider trace.TracerProvider

	// DisableListen makes the relay poll only, holding no LISTEN
	// connection: for connection poolers that cannot LISTEN.
	DisableListen bool

	// Hooks observe the relay, and inject failures in tests.
	Hooks Hooks
}

// Hooks are the relay's observation and failure-injection points. Zero
// fields are no-ops.
type Hooks struct {
	// ObservePublishFunc, when set, is called for each acked event with the
	// time from the commit of its claim to its ack. It is called from the
	// relay's workers and must be safe for concurrent use and quick.
	ObservePublishFunc func(time.Duration)

	// FailpointFunc is failure injection, for tests and chaos runs: when
	// set, the relay calls it at each of these points, and a non-nil error
	// makes the relay behave as if it died there (it abandons the batch,
	// publishing and marking nothing more, and the lease expires):
	//
	//	"outbox.after_claim"            once per batch, its claim committed, nothing published
	//	"outbox.before_publish"         once per event, before it is handed to the broker
	//	"outbox.after_ack_before_mark"  once per batch with acks, before they are marked
	//	"outbox.retention_mid_batch"    between two of retention's delete statements
	//	"outbox.cdc_after_mark"         ModeCDC: acked events marked, their position not yet confirmed to the slot
	//
	// In ModeCDC a failpoint that fires ends the relay's stream as a crash
	// would: it starts again from the slot's confirmed position.
	FailpointFunc func(name string) error
}

// The points at which the relay calls Hooks.FailpointFunc.
const (
	failpointAfterClaim         = "outbox.after_claim"
	failpointBeforePublish      = "outbox.before_publish"
	failpointAfterAckBeforeMark = "outbox.after_ack_before_mark"
	failpointRetentionMidBatch  = "outbox.retention_mid_batch"
	failpointCDCAfterMark       = "outbox.cdc_after_mark"
)

func (c *Config) failpoint(name string) error {
	if c.Hooks.FailpointFunc == nil {
		return nil
	}
	return c.Hooks.FailpointFunc(name)
}

func (c *Config) setDefaults() {
	if c.Name == "" {
		host, _ := os.Hostname()
		c.Name = fmt.Sprintf("%s-%d-%04x", cmp.Or(host, "relay"), os.Getpid(), rand.Uint32()&0xffff)
	}
	c.BatchSize = cmp.Or(c.BatchSize, 500)
	c.Workers = cmp.Or(c.Workers, 2)
	c.PollInterval = cmp.Or(c.PollInterval, time.Second)
	c.LeaseDuration = cmp.Or(c.LeaseDuration, 15*time.Second)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, min(3*time.Second, c.LeaseDuration/3))
	c.BackoffBase = cmp.Or(c.BackoffBase, 250*time.Millisecond)
	c.BackoffMax = cmp.Or(c.BackoffMax, 30*time.Second)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, 10)
	c.OutageBackoffMax = cmp.Or(c.OutageBackoffMax, 2*time.Second)
	c.Retention = cmp.Or(c.Retention, 72*time.Hour)
	c.RetentionInterval = cmp.Or(c.RetentionInterval, time.Minute)
	c.RetentionBatch = cmp.Or(c.RetentionBatch, 1000)
	c.Mode = cmp.Or(c.Mode, ModePoll)
	c.HandOff = cmp.Or(c.HandOff, 10*time.Second)
	c.SlotDropHint = cmp.Or(c.SlotDropHint, "outbox.DropSlot(ctx, db, slot)")
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *Config) validate() error {
	switch {
	case c.Mode != ModePoll && c.Mode != ModeCDC:
		return fmt.Errorf("outbox relay: Mode %q is neither %q nor %q", c.Mode, ModePoll, ModeCDC)
	case c.BatchSize < 1 || c.Workers < 1 || c.MaxAttempts < 1 || c.RetentionBatch < 1:
		return errors.New("outbox relay: BatchSize, Workers, MaxAttempts and RetentionBatch must be positive")
	case c.PublishTimeout*2 > c.LeaseDuration:
		// A batch must be marked while its lease still holds, or another
		// relay publishes it again on every round.
		return fmt.Errorf("outbox relay: PublishTimeout %v must be at most half of LeaseDuration %v", c.PublishTimeout, c.LeaseDuration)
	case c.BackoffBase > c.BackoffMax || c.BackoffBase > c.OutageBackoffMax:
		return fmt.Errorf("outbox relay: BackoffBase %v exceeds BackoffMax %v or OutageBackoffMax %v", c.BackoffBase, c.BackoffMax, c.OutageBackoffMax)
	}
	return nil
}

// RetryHorizon bounds how long after an event's first publish the relay may
// publish another copy of it while the broker works (an outage stretches it
// by its length). Consumers must remember event ids longer than this
// (pkg/inbox), and the stream's duplicate window should be longer too, so
// that it drops the copies of ordinary retries.
func (c Config) RetryHorizon() time.Duration {
	c.setDefaults()
	return time.Duration(c.MaxAttempts) * (c.LeaseDuration + c.PublishTimeout + c.BackoffMax)
}
