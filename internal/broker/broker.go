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
// (`sync_interval: always`; internal/app/compose_test.go holds the files to
// it). What it costs is measured by `make bench` (docs/performance.md).
// What a broker loses anyway — a disk, a hand that deletes messages — is
// found by internal/verify's stream audit and republished from the outbox.
//
// # Who may do what on NATS
//
// Anyone who reaches an unsecured NATS server may publish into any stream
// (a forged OrderCreated, a PaymentSucceeded nobody paid), delete or purge a
// stream, or pull another service's messages. So every shop service
// connects as its own NATS user, whose [Permissions] allow what that
// service does and nothing else: publish its own events, ensure its own
// stream, run its own durable consumers on the streams it reads. The
// server refuses the rest with a permissions violation, which the client
// logs. Each service's [Access] comes from its registry entry
// (internal/registry); the embedded server of `shop all` gets them as
// [Users], and deploy/nats/auth.conf is their rendering ([AuthConfig]),
// which a test holds to the registry.
package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
// consumer's replay window. internal/app checks that at start-up.
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

// EnsureStream creates the stream of one producing service, or updates it to
// this configuration: file storage, limits retention (messages stay after
// they are consumed, so any consumer can replay), the duplicate window,
// DefaultLimits, and replicas copies (1 on a single server; 3 on a
// three-node cluster, so the stream survives the loss of a node; durable
// consumers inherit it).
func EnsureStream(ctx context.Context, js jetstream.JetStream, name string, replicas int, subjects ...string) (jetstream.Stream, error) {
	return EnsureStreamWith(ctx, js, name, replicas, DefaultLimits, subjects...)
}

// EnsureStreamWith is EnsureStream with the given limits.
func EnsureStreamWith(ctx context.Context, js jetstream.JetStream, name string, replicas int, limits Limits, subjects ...string) (jetstream.Stream, error) {
	want := streamConfig(name, replicas, limits, subjects)
	// Look first and change only what differs: every service ensures every
	// stream it uses at start-up, and an update of a stream while another
	// process creates a consumer on it is needless churn (nats-server 2.15
	// even races on it internally).
	st, err := js.Stream(ctx, name)
	switch {
	case err == nil && sameStream(st.CachedInfo().Config, want):
		return st, nil
	case err == nil:
		st, err = js.UpdateStream(ctx, want)
	case errors.Is(err, jetstream.ErrStreamNotFound):
		st, err = js.CreateStream(ctx, want)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return EnsureStreamWith(ctx, js, name, replicas, limits, subjects...) // another process created it just now
		}
	}
	if err != nil {
		return nil, fmt.Errorf("ensure stream %s: %w", name, err)
	}
	return st, nil
}

// CreateStreamIfMissing returns the stream called name as it is, or
// creates it with EnsureStreamWith's configuration when it does not exist.
// It is how a consumer ensures the stream it reads, which its producer owns:
// a consumer may start first, and only the owner may change the stream (its
// NATS user may update it; a reader's may only create it).
func CreateStreamIfMissing(ctx context.Context, js jetstream.JetStream, name string, replicas int, limits Limits, subjects ...string) (jetstream.Stream, error) {
	st, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		st, err = js.CreateStream(ctx, streamConfig(name, replicas, limits, subjects))
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			st, err = js.Stream(ctx, name) // another process created it just now
		}
	}
	if err != nil {
		return nil, fmt.Errorf("look up stream %s: %w", name, err)
	}
	return st, nil
}

func streamConfig(name string, replicas int, limits Limits, subjects []string) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:       name,
		Subjects:   subjects,
		Storage:    jetstream.FileStorage,
		Retention:  jetstream.LimitsPolicy,
		Duplicates: DuplicateWindow,
		Replicas:   max(replicas, 1),
		MaxAge:     limits.MaxAge,
		MaxBytes:   cmpOr(limits.MaxBytes, -1),
		Discard:    jetstream.DiscardNew,
	}
}

func cmpOr(n, alt int64) int64 {
	if n == 0 {
		return alt
	}
	return n
}

func sameStream(have, want jetstream.StreamConfig) bool {
	return slices.Equal(have.Subjects, want.Subjects) && have.Storage == want.Storage &&
		have.Retention == want.Retention && have.Duplicates == want.Duplicates && have.Replicas == want.Replicas &&
		have.MaxAge == want.MaxAge && have.MaxBytes == want.MaxBytes && have.Discard == want.Discard
}
