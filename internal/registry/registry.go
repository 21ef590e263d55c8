// Package registry is how a shop service declares itself: one Entry, in the
// service's own package (services/<name>/registration.go), and one list of every
// entry (services.All). Whatever in the shop needs to know its services —
// migrations, configuration and its defaults, NATS users and permissions,
// streams, start-up wiring, metrics, order admission, `shop verify`, the
// reconciler, the dashboard, `shop outbox`, the chaos run, the benchmark —
// iterates that list, so adding a service is its own package, its
// migrations and one line (docs/adding-a-service.md).
//
// A missing or inconsistent declaration is an error at start-up that says
// what to add and where (Registry.Validate, and the checks cmd/shop/app
// makes of a built service against its entry), never a silent default.
package registry

import (
	"context"
	"io/fs"
	"log/slog"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/inbox"
)

// Entry declares one service.
type Entry struct {
	// Name is the service's name: the command that runs it alone (`shop
	// order`), its NATS user, its migrations directory (migrations/<Name>/)
	// and the prefix of its variables (ORDER_ADDR, ORDER_DATABASE_URL).
	// Lower case letters only.
	Name string
	// Schema is the Postgres schema it owns.
	Schema string
	// Stream is the JetStream stream it owns and publishes to, and Prefix
	// the first token of every subject in it: <Prefix>.<aggregate id>.<type>.
	// The service's outbox writer makes its subjects from the same Prefix
	// (outbox.Writer.Prefix).
	Stream, Prefix string
	// Addr is its default HTTP listen address; <NAME>_ADDR overrides it.
	Addr string
	// PoolSize is how many database connections its pool may open: each of
	// its consumers' Workers plus two, the relay's workers plus one, and
	// room for HTTP handlers and its background jobs.
	PoolSize int32
	// Libraries are the libraries' migrations its schema carries besides
	// the outbox's and the inbox's (which every schema has):
	// migrations.Saga() for a service that runs a saga.
	Libraries []migrations.Set
	// Migrations are its own tables, as goose SQL files. Default:
	// migrations/<Name>/*.sql, which package migrations embeds (a test's
	// service brings its own).
	Migrations fs.FS
	// Consumers are the durable consumers it runs, each on another
	// service's stream. Start-up checks that the built service runs exactly
	// these (Domain.Consumers).
	Consumers []Consumer
	// Configure declares the service's own settings on env (each an
	// environment variable that a flag overrides; none: ignore env) and
	// returns its constructor, which the shop calls once the command line
	// is parsed. Required.
	Configure func(env *Env) NewFunc
	// Facts pair the service's business rows with the events that announce
	// them, for `shop verify` (invariants 1 and 2).
	Facts []Fact
	// Checks are the service's other invariants for `shop verify`. Every
	// service is also checked for what the outbox and inbox promise: every
	// event intent published, sequences gap-free, no dead letters, nothing
	// parked for long, every consumer has processed every event it reads.
	Checks []Check
}

// Sets are the migration sets of e's schema after the outbox's and the
// inbox's, which every schema has (migrations.Apply): its libraries', then
// its own.
func (e Entry) Sets() []migrations.Set {
	own := migrations.Service(e.Name)
	if e.Migrations != nil {
		own = migrations.Own(e.Name, e.Migrations)
	}
	return append(append([]migrations.Set(nil), e.Libraries...), own)
}

// Consumer declares a durable consumer.
type Consumer struct {
	// Name is the durable JetStream consumer and the consumer_name in the
	// inbox tables: <service>-<what it reads>, e.g. "inventory-orders".
	Name string
	// Stream is the stream it reads: another service's Entry.Stream.
	Stream string
	// Types are the event types JetStream delivers to it (a filter on the
	// subjects); nil: every event of the stream. A consumer that filters
	// cannot keep the per-aggregate sequence check (pkg/inbox).
	Types []string
	// Handles are the event types its handler applies, of those it
	// receives; nil: all of them. The others are only recorded (pkg/inbox
	// Config.Handles).
	Handles []string
	// Saga says that the consumer carries orders through their saga: its
	// backlog counts towards the order service's admission (POST /orders
	// answers 503 while the saga's consumers lag). A side consumer (loyalty
	// points, analytics) leaves it false, so its lag never throttles
	// orders.
	Saga bool
}

// Fact pairs one kind of business row with the event that announces it:
// each row has exactly one such event (invariant 1) and each event has its
// row (invariant 2), within the window `shop verify` looks at.
type Fact struct {
	// What the rows are, as the report names them: "order", "shipment".
	What string
	// SQL selects the rows committed since $1 (a timestamptz) on the
	// service's schema as (key text, n bigint): n rows for each key.
	SQL string
	// EventType is the type of the announcing event.
	EventType string
	// EventKey is the SQL expression over the outbox row that gives the
	// key it announces: "aggregate_id", "payload->>'payment_id'".
	EventKey string
}

// Check is an invariant `shop verify` checks against the service's schema.
type Check struct {
	Invariant int    // 1–4, as the contract numbers them
	Name      string // what holds when the check passes
	// SQL runs on the service's schema; each row it returns (one text
	// column) describes one violation. It takes no parameters but From's.
	SQL string
	// From, when set, runs first on another service's schema, and its rows
	// (one text column) are passed to SQL as $1, a text[]: for the
	// invariants that compare two services' tables (the orders whose saga
	// has ended, and the stock still reserved for them).
	From *Query
}

// Query is SQL to run on a service's schema.
type Query struct {
	Service string // the Entry.Name whose schema it reads
	SQL     string
}

// NewFunc builds a service's business part from what the shop gives it. It
// does no I/O.
type NewFunc func(Deps) (Domain, error)

// Deps are what the shop gives a service to build itself.
type Deps struct {
	// Pool connects to the service's database with its schema on the
	// search_path, sized by Entry.PoolSize.
	Pool *pgxpool.Pool
	// JetStream publishes and consumes as the service's own NATS user.
	JetStream jetstream.JetStream
	// Logger carries the service's name.
	Logger *slog.Logger
	// TracerProvider makes the service's spans; a no-op provider when
	// traces are not exported.
	TracerProvider trace.TracerProvider
	// Readers are every consumer of the shop with the service that runs it,
	// for what one service needs to know of the others' (the order
	// service's admission counts the saga's).
	Readers []Reader
	// Hooks are where the shop observes the service, and where tests and
	// the chaos run interrupt it.
	Hooks Hooks
}

// Hooks are the service's observation and failure-injection points. Zero
// fields are no-ops.
type Hooks struct {
	// FailpointFunc is called at each failpoint the service and its
	// consumers pass (internal/failpoint.Inject, armed by SHOP_FAILPOINTS).
	FailpointFunc func(name string) error
	// ObserveInboxFunc receives each of its consumers' processing times
	// (inbox.Hooks.ObserveFunc), for the service's metrics.
	ObserveInboxFunc func(consumer string, d time.Duration)
}

// Reader is a consumer with the service that runs it.
type Reader struct {
	Service string
	Consumer
}

// Domain is a built service's business part.
type Domain interface {
	// Routes adds its HTTP routes (the shop adds /healthz, /readyz and
	// /metrics).
	Routes(r chi.Router)
	// Run runs its consumers and background jobs until ctx ends.
	Run(ctx context.Context) error
	// Consumers are its inbox consumers, whose metrics, windows and stream
	// limits the shop watches and checks: exactly the Entry's Consumers.
	Consumers() []*inbox.Consumer
}

// ConsumerWorkers is the Workers of every consumer of the shop. A worker
// applies up to BatchSize deliveries in one transaction, so two keep a
// consumer's share of two cores busy; each costs a Postgres connection
// (a consumer needs Workers+2), and the connection budget
// (docs/operations.md) is what lets several copies of every service share
// one default Postgres.
const ConsumerWorkers = 2

// InboxRetention is how long every consumer of the shop remembers the ids
// of the events it processed (inbox.Config.Retention): longer than a relay
// retries (outbox.Config.RetryHorizon), than a stream's duplicate window
// (internal/broker) and than ReplayWindow, so that no copy of an event can
// come after its id is forgotten.
const InboxRetention = 14 * 24 * time.Hour

// ReplayWindow is how far back an operator may replay a stream into its
// consumers: the streams keep their messages at least this long.
const ReplayWindow = 7 * 24 * time.Hour

// Inbox is the inbox configuration of consumer c of a service built with d,
// applying events with handler: its name, stream, filter and handled types,
// and the shop's windows, logger, tracer and hooks. The service sets what
// is its own (Workers, BatchSize) on the result.
func (d Deps) Inbox(c Consumer, handler inbox.HandlerFunc) inbox.Config {
	cfg := inbox.Config{
		Workers: ConsumerWorkers,
		Name:    c.Name,
		Stream:  c.Stream,
		Handler: handler,
		Handles: c.Handles,
		// Start-up checks it against the relays' retry horizon and the
		// streams' duplicate window and replay window (cmd/shop/app).
		Retention:      InboxRetention,
		Logger:         d.Logger,
		TracerProvider: d.TracerProvider,
		Hooks:          inbox.Hooks{ObserveFunc: d.Hooks.ObserveInboxFunc, FailpointFunc: d.Hooks.FailpointFunc},
	}
	for _, t := range c.Types {
		// Every subject of a stream is <prefix>.<aggregate id>.<type>.
		cfg.FilterSubjects = append(cfg.FilterSubjects, "*.*."+t)
	}
	// The sequence check needs every event of an aggregate: a consumer that
	// filters by type must do without it (see pkg/inbox).
	cfg.SkipSequenceCheck = len(c.Types) > 0
	return cfg
}

// Log is d's logger, a discarding one when none is set.
func (d Deps) Log() *slog.Logger {
	if d.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return d.Logger
}

// Failpoint calls FailpointFunc, if any, at the failpoint called name.
func (h Hooks) Failpoint(name string) error {
	if h.FailpointFunc == nil {
		return nil
	}
	return h.FailpointFunc(name)
}

// Access is what e does on NATS (broker.Permissions): publish to its own
// subjects, own its stream, run its durables on the streams it reads.
func (e Entry) Access() broker.Access {
	a := broker.Access{User: e.Name, Stream: e.Stream, Subjects: []string{e.Prefix + ".>"}}
	for _, c := range e.Consumers {
		a.Durables = append(a.Durables, broker.Durable{Stream: c.Stream, Name: c.Name})
	}
	return a
}
