// Package broker holds the NATS plumbing shared by the services, the demo and
// the tests: an embedded JetStream server and the streams of the contract.
//
// # When an acknowledged message is durable
//
// JetStream acknowledges a publish once the message is in its store, and by
// default it fsyncs that store only every two minutes (nats-server's
// sync_interval). A process crash loses nothing — the data is in the
// operating system's page cache — but an OS crash or a power loss loses
// what was acknowledged since the last fsync, and the outbox relay, which
// marks an event published on its PubAck, never sends it again (Jepsen
// lost acknowledged writes of NATS 2.12.1 this way, with three replicas
// under a coordinated power loss). So every server the shop starts or
// ships fsyncs before it acknowledges: [Embedded] by default, and
// docker-compose.yml's servers through deploy/nats/*.conf
// (`sync_interval: always`; cmd/shop/app/compose_test.go holds the files to
// it). What it costs is measured by `make bench` (docs/performance.md).
// What a broker loses anyway — a disk, a hand that deletes messages — is
// found by ops/verify's stream audit and republished from the outbox.
//
// # Who may do what on NATS
//
// Anyone who reaches an unsecured NATS server may publish into any stream
// (a forged OrderCreated, a PaymentSucceeded nobody paid), delete or purge a
// stream, or pull another service's messages. So every shop service
// connects as its own NATS user, whose [Permissions] allow what that
// service does and nothing else: publish its own events, look up its own
// stream and the streams it reads, run its own durable consumers on the
// streams it reads. The server refuses the rest with a permissions
// violation, which the client logs. No service may create a stream or
// change one's configuration: one service's credentials were enough to
// make a stream republish into another's, allow a rollup that empties it,
// or, created before the shop, keep its events in memory. Only the stream
// keeper ([StreamsUser]) creates and updates streams, to hold them to
// [StreamConfig] ([Drift] says what differs), and the audit user
// ([AuditUser]) reads without creating anything. Each service's [Access]
// comes from its registry entry (internal/registry); the embedded server
// of `shop all` gets them as [Users], and deploy/nats/auth.conf is their
// rendering ([AuthConfig]), which a test holds to the registry.
package broker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
)

// ServerDefaultSyncInterval is nats-server's own default fsync interval,
// which [Embedded] does not use unless asked to ([WithSyncInterval]).
const ServerDefaultSyncInterval = 2 * time.Minute

// Option changes how [Embedded] configures its server.
type Option func(*server.Options)

// WithSyncAlways makes the server fsync every write to a stream before it
// acknowledges it: an acknowledged message survives an OS crash or a power
// loss. This is Embedded's default; the option exists to say so.
func WithSyncAlways() Option {
	return func(o *server.Options) { o.SyncAlways, o.SyncInterval = true, ServerDefaultSyncInterval }
}

// WithSyncInterval makes the server fsync its streams every d instead of
// before each acknowledgement, as nats-server does by default (d =
// ServerDefaultSyncInterval). Faster; an OS crash or power loss then loses
// up to d of acknowledged messages, which the relay never republishes by
// itself. Only for servers whose data does not matter (tests).
func WithSyncInterval(d time.Duration) Option {
	return func(o *server.Options) { o.SyncAlways, o.SyncInterval = false, d }
}

// Embedded starts a NATS server with JetStream inside this process, listening
// on host:port (port -1 picks a free one) and storing streams under storeDir.
// Unless an option says otherwise it fsyncs before every acknowledgement
// (WithSyncAlways): this is the server of `shop all`, and an event the relay
// saw acknowledged must not vanish in an OS crash.
func Embedded(host string, port int, storeDir string, opts ...Option) (*server.Server, error) {
	o := &server.Options{
		Host:      host,
		Port:      port,
		JetStream: true,
		StoreDir:  storeDir,
		NoSigs:    true,
		NoLog:     true,
	}
	for _, opt := range append([]Option{WithSyncAlways()}, opts...) {
		opt(o)
	}
	s, err := server.NewServer(o)
	if err != nil {
		return nil, fmt.Errorf("embedded nats: %w", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, errors.New("embedded nats: not ready after 10s")
	}
	return s, nil
}

// DuplicateWindow is how long JetStream remembers a Nats-Msg-Id and drops a
// second copy. The relay republishes an event it could not mark published
// well within it; consumers' inboxes absorb copies that arrive later.
const DuplicateWindow = 10 * time.Minute

// Limits bound what a stream keeps. A stream is the only copy of an event
// once its outbox row is deleted (the outbox's retention), and consumers
// replay from it, so the limits must keep every message at least as long as
// anything may still need it: MaxAge at least the outbox's retention (the
// stream audit looks for every event published within it) and every
// consumer's replay window. cmd/shop/app checks that at start-up.
type Limits struct {
	// MaxAge drops messages older than this; 0: kept for ever.
	MaxAge time.Duration
	// MaxBytes bounds the stream's size; 0: unbounded. A full stream
	// refuses new messages (JetStream's DiscardNew) instead of dropping old
	// ones that a consumer may not have read: the relay sees "unavailable",
	// keeps the events in the outbox and waits (an outage, no attempts
	// counted) until an operator makes room.
	MaxBytes int64
}

// DefaultLimits keep a message eight days — a day more than the inboxes'
// replay window (7 days), and well beyond the outboxes' retention (72 hours)
// — with no bound on bytes.
var DefaultLimits = Limits{MaxAge: 8 * 24 * time.Hour}

// StreamConfig is the shop's configuration of the stream called name: the
// one every stream of the contract is created with and the one its keeper
// restores. File storage, limits retention (messages stay after they are
// consumed, so any consumer can replay), the duplicate window, limits, and
// replicas copies (1 on a single server; 3 on a three-node cluster, so the
// stream survives the loss of a node; durable consumers inherit it). Also:
//
//   - DenyDelete and DenyPurge: no client may remove a message, whatever
//     its NATS permissions say; a stream is the only copy of an event once
//     its outbox row is gone. JetStream refuses to switch either off again,
//     and refuses rollups on a stream that denies purges, so a message with
//     `Nats-Rollup: all` cannot empty the stream even for a user who may
//     update it. Nothing in the shop deletes or purges a stream's messages:
//     they leave by MaxAge only.
//   - AllowDirect: the stream audit (ops/verify) reads messages by
//     direct get, which needs no consumer, so the audit user creates
//     nothing on the server.
//   - the limits nats-server would fill in with its own defaults (MaxMsgs,
//     MaxMsgsPerSubject, MaxMsgSize, MaxConsumers: -1, none), so that the
//     configuration a server reports for a stream created with it is this
//     one, field for field, and [Drift] needs no knowledge of the server's
//     defaults.
func StreamConfig(name string, replicas int, limits Limits, subjects ...string) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:              name,
		Subjects:          subjects,
		Storage:           jetstream.FileStorage,
		Retention:         jetstream.LimitsPolicy,
		Duplicates:        DuplicateWindow,
		Replicas:          max(replicas, 1),
		MaxAge:            limits.MaxAge,
		MaxBytes:          cmpOr(limits.MaxBytes, -1),
		Discard:           jetstream.DiscardNew,
		MaxMsgs:           -1,
		MaxMsgsPerSubject: -1,
		MaxMsgSize:        -1,
		MaxConsumers:      -1,
		DenyDelete:        true,
		DenyPurge:         true,
		AllowDirect:       true,
	}
}

// EnsureStream creates the stream of one producing service with
// StreamConfig and DefaultLimits, or restores that configuration where the
// stream differs from it ([KeepStream]). Only a user that may update
// streams can restore one: the shop's stream keeper ([StreamsUser]), or a
// test's.
func EnsureStream(ctx context.Context, js jetstream.JetStream, name string, replicas int, subjects ...string) (jetstream.Stream, error) {
	return EnsureStreamWith(ctx, js, name, replicas, DefaultLimits, subjects...)
}

// EnsureStreamWith is EnsureStream with the given limits.
func EnsureStreamWith(ctx context.Context, js jetstream.JetStream, name string, replicas int, limits Limits, subjects ...string) (jetstream.Stream, error) {
	st, _, err := KeepStream(ctx, js, StreamConfig(name, replicas, limits, subjects...))
	return st, err
}

// KeepStream creates the stream want describes when it is missing, or
// restores want when the stream's configuration drifted (RestoreStream),
// and returns the stream and the drift it found.
func KeepStream(ctx context.Context, js jetstream.JetStream, want jetstream.StreamConfig) (jetstream.Stream, []FieldDrift, error) {
	st, err := CreateStreamIfMissing(ctx, js, want)
	if err != nil {
		return nil, nil, err
	}
	return RestoreStream(ctx, js, st, want)
}

// RestoreStream updates st to want when its configuration (as st was read)
// drifted from it, and returns the stream and the drift it found (none: it
// was as wanted, and is left alone: an update while another process creates
// a consumer on the stream is needless churn, and nats-server 2.15 even
// races on it internally). An update JetStream refuses is returned as an
// error, with the drift: some fields cannot be changed back (Sealed,
// Storage, a Mirror, AllowMsgTTL, …), and such a stream needs an operator.
func RestoreStream(ctx context.Context, js jetstream.JetStream, st jetstream.Stream, want jetstream.StreamConfig) (jetstream.Stream, []FieldDrift, error) {
	drift := Drift(st.CachedInfo().Config, want)
	if len(drift) == 0 {
		return st, nil, nil
	}
	updated, err := js.UpdateStream(ctx, want)
	if err != nil {
		return st, drift, fmt.Errorf("restore stream %s %v: %w", want.Name, DriftFields(drift), err)
	}
	return updated, drift, nil
}

// CreateStreamIfMissing returns the stream called cfg.Name as it is, or
// creates it with cfg when it does not exist (which only a user that may
// create streams can: the stream keeper, or a test's). JetStream never
// changes an existing stream on a create; what differs is the caller's to
// report ([Drift]) and the stream keeper's to restore.
func CreateStreamIfMissing(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	st, err := js.Stream(ctx, cfg.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		st, err = createStream(ctx, js, cfg)
	}
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", cfg.Name, err)
	}
	return st, nil
}

// createStream creates the stream cfg describes; one that another process
// created just now is returned as it is.
func createStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	st, err := js.CreateStream(ctx, cfg)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return js.Stream(ctx, cfg.Name)
	}
	return st, err
}

func cmpOr(n, alt int64) int64 {
	if n == 0 {
		return alt
	}
	return n
}
