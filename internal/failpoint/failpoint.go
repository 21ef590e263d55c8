// Package failpoint provides named crash points ("failpoints") at the
// durable boundaries of the shop: places where a process that dies, or a
// call that fails, leaves a window another part of the system must close
// (a lease expiring, a redelivery, a client retrying with its key).
//
// Failpoints are compiled into the real code path and are inert unless
// switched on. Init reads the configuration once, from the environment
// variable SHOP_FAILPOINTS, which cmd/shop passes in at start-up:
//
//	SHOP_FAILPOINTS='name=action[@count][,name2=action2[@count]...]'
//
// where action is one of
//
//	crash            write one line naming the failpoint to stderr and exit
//	                 with status 137, as if the process were SIGKILLed: no
//	                 deferred function runs, no transaction is rolled back
//	                 politely, no response is sent
//	error            Inject returns an error wrapping ErrInjected; the code
//	                 at the point treats it as the real failure there
//	sleep(<dur>)     sleep for a time.ParseDuration duration, then go on
//
// and @count makes the action fire on the count-th hit of that point only
// (default: every hit). For example
//
//	SHOP_FAILPOINTS=outbox.after_ack_before_mark=crash@3
//
// kills the process the third time a relay worker has its broker acks and
// is about to mark the events published. Unknown names are refused by Init.
//
// Libraries under pkg/ must not import internal packages: each takes one
// failure-injection hook, FailpointFunc among its Config's hooks
// (outbox.Hooks, inbox.Hooks, saga.Hooks), documents the names it passes
// there (names_test.go holds the registry to them), and cmd/shop/app sets
// it to Inject. With nothing configured, Inject is one atomic load.
package failpoint

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// EnvVar is the environment variable Init reads.
const EnvVar = "SHOP_FAILPOINTS"

// The failpoints. Each name says where it sits: <component>.<boundary>.
const (
	// OrderAfterCommitBeforeResponse: POST /orders has committed the order,
	// its saga, key and OrderCreated, and has not answered. The client sees
	// no response and retries with the same Idempotency-Key.
	OrderAfterCommitBeforeResponse = "order.after_commit_before_response"
	// OutboxAfterClaim: a relay has committed its claim (lease) on a batch
	// and has published nothing. The lease expires; another relay (or this
	// one, restarted) publishes the batch.
	OutboxAfterClaim = "outbox.after_claim"
	// OutboxBeforePublish: a relay is about to publish a claimed batch.
	// As OutboxAfterClaim, and also the last moment before the broker can
	// have stored anything.
	OutboxBeforePublish = "outbox.before_publish"
	// OutboxAfterAckBeforeMark: the broker has acked the batch, the relay
	// has not marked it published. The lease expires and the batch is
	// published again; the stream's duplicate window (Nats-Msg-Id) or the
	// consumers' inbox absorbs the copy.
	OutboxAfterAckBeforeMark = "outbox.after_ack_before_mark"
	// OutboxCDCAfterMark: a relay in CDC mode has marked acked events
	// published and has not confirmed their position to its slot. The
	// next stream starts at the confirmed position and publishes them
	// again, same ids; the duplicate window or the inbox absorbs them.
	OutboxCDCAfterMark = "outbox.cdc_after_mark"
	// InboxBeforeCommit: a consumer's handler has run in the inbox
	// transaction, which has not committed. The transaction rolls back, the
	// message is redelivered after AckWait and applied then.
	InboxBeforeCommit = "inbox.before_commit"
	// InboxAfterCommitBeforeAck: the inbox transaction has committed, the
	// message is not acked. The redelivery is a duplicate the inbox row
	// absorbs.
	InboxAfterCommitBeforeAck = "inbox.after_commit_before_ack"
	// SagaAfterClaimTimeout: a saga scanner has claimed a due timeout (row
	// locks, uncommitted). The transaction rolls back and the timeout fires
	// on a later scan, once.
	SagaAfterClaimTimeout = "saga.after_claim_timeout"
	// OutboxRetentionMidBatch: retention has committed one delete batch of
	// published events and is about to run the next. The rest is deleted by
	// the next run; pending and dead events are never touched.
	OutboxRetentionMidBatch = "outbox.retention_mid_batch"
	// PaymentWebhookAfterCommitBeforeResponse: a provider callback has been
	// recorded (payment row and event committed), the provider has no
	// answer. The provider retries; the retry is a harmless replay.
	PaymentWebhookAfterCommitBeforeResponse = "payment.webhook_after_commit_before_response"
	// PaymentRefundAfterProviderBeforeStore: the provider has refunded, the
	// result is not stored. The refund lease expires and the retry asks the
	// provider again with the same idempotency key: one refund.
	PaymentRefundAfterProviderBeforeStore = "payment.refund_after_provider_before_store"
)

// registry is every known failpoint name. Tests of this package may add
// names of their own (register).
var registry = []string{
	OrderAfterCommitBeforeResponse,
	OutboxAfterClaim,
	OutboxBeforePublish,
	OutboxAfterAckBeforeMark,
	OutboxCDCAfterMark,
	InboxBeforeCommit,
	InboxAfterCommitBeforeAck,
	SagaAfterClaimTimeout,
	OutboxRetentionMidBatch,
	PaymentWebhookAfterCommitBeforeResponse,
	PaymentRefundAfterProviderBeforeStore,
}

// Names returns the known failpoint names, sorted.
func Names() []string {
	out := slices.Clone(registry)
	slices.Sort(out)
	return out
}

// ErrInjected is wrapped by the error an `error` failpoint returns.
var ErrInjected = errors.New("failpoint: injected error")

// CrashExitCode is the exit status of a `crash` failpoint: 128+9, what a
// shell reports for a process killed by SIGKILL.
const CrashExitCode = 137

type kind int

const (
	kindCrash kind = iota + 1
	kindError
	kindSleep
)

// point is one configured failpoint.
type point struct {
	name  string
	kind  kind
	sleep time.Duration
	count int64 // fire on this hit only; 0: every hit
	hits  atomic.Int64
}

// config is a parsed SHOP_FAILPOINTS.
type config struct {
	spec   string
	points map[string]*point
}

// active is nil when no failpoint is configured: the off path of Inject.
var active atomic.Pointer[config]

// exit ends the process at a crash failpoint.
var exit = os.Exit

// Init reads SHOP_FAILPOINTS through getenv and arms the failpoints it
// names, replacing any earlier configuration; an empty or unset variable
// disarms them all. It returns an error, and changes nothing, when the
// value does not parse or names an unknown failpoint. cmd/shop calls it
// once at start-up; it is safe to call concurrently with Inject.
func Init(getenv func(string) string) error {
	c, err := parse(getenv(EnvVar))
	if err != nil {
		return err
	}
	active.Store(c)
	return nil
}

// Spec returns the active configuration as given to Init, or "" when no
// failpoint is armed.
func Spec() string {
	if c := active.Load(); c != nil {
		return c.spec
	}
	return ""
}

// Inject is called at the failpoint called name. It returns nil unless the
// failpoint is armed and fires: then it crashes the process, returns an
// error wrapping ErrInjected, or sleeps and returns nil. Off, it costs one
// atomic load.
func Inject(name string) error {
	c := active.Load()
	if c == nil {
		return nil
	}
	return c.hit(name)
}

func (c *config) hit(name string) error {
	p := c.points[name]
	if p == nil {
		return nil
	}
	n := p.hits.Add(1)
	if p.count != 0 && n != p.count {
		return nil
	}
	switch p.kind {
	case kindCrash:
		// One line, then gone: os.Exit runs no deferred functions, which
		// is the point. stderr is unbuffered, so the line is out.
		fmt.Fprintf(os.Stderr, "failpoint %s: crash (hit %d), exiting with status %d as if killed\n", name, n, CrashExitCode)
		exit(CrashExitCode)
		return fmt.Errorf("failpoint %s: %w (crash)", name, ErrInjected) // only when exit is replaced
	case kindError:
		return fmt.Errorf("failpoint %s (hit %d): %w", name, n, ErrInjected)
	case kindSleep:
		time.Sleep(p.sleep)
	}
	return nil
}

// parse turns a SHOP_FAILPOINTS value into a configuration; nil when empty.
func parse(spec string) (*config, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return nil, nil
	}
	c := &config{spec: spec, points: map[string]*point{}}
	for entry := range strings.SplitSeq(spec, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		name, action, ok := strings.Cut(entry, "=")
		name, action = strings.TrimSpace(name), strings.TrimSpace(action)
		if !ok || name == "" || action == "" {
			return nil, fmt.Errorf("%s: entry %q is not name=action[@count]", EnvVar, entry)
		}
		if !slices.Contains(registry, name) {
			return nil, fmt.Errorf("%s: unknown failpoint %q; known failpoints: %s", EnvVar, name, strings.Join(Names(), ", "))
		}
		if _, dup := c.points[name]; dup {
			return nil, fmt.Errorf("%s: failpoint %q is configured twice", EnvVar, name)
		}
		p := &point{name: name}
		if a, cnt, ok := strings.Cut(action, "@"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(cnt), 10, 64)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("%s: failpoint %q: count %q must be a positive integer", EnvVar, name, cnt)
			}
			p.count, action = n, strings.TrimSpace(a)
		}
		switch {
		case action == "crash":
			p.kind = kindCrash
		case action == "error":
			p.kind = kindError
		case strings.HasPrefix(action, "sleep(") && strings.HasSuffix(action, ")"):
			d, err := time.ParseDuration(strings.TrimSpace(action[len("sleep(") : len(action)-1]))
			if err != nil || d < 0 {
				return nil, fmt.Errorf("%s: failpoint %q: %q needs a non-negative duration such as sleep(500ms)", EnvVar, name, action)
			}
			p.kind, p.sleep = kindSleep, d
		default:
			return nil, fmt.Errorf("%s: failpoint %q: unknown action %q (want crash, error or sleep(<duration>))", EnvVar, name, action)
		}
		c.points[name] = p
	}
	if len(c.points) == 0 {
		return nil, nil
	}
	return c, nil
}
