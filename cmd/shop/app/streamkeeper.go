package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
)

// The stream keeper. A stream's configuration is part of the contract: a
// stream that republishes into another's subjects, allows rollups, keeps
// its messages in memory, has lost its duplicate window or keeps messages
// an hour is a weapon or a loss, whoever made it so. No service's NATS user
// may create or update a stream (broker.Permissions); the keeper's user
// (broker.StreamsUser) may, and a process given its password
// (STREAMS_NATS_PASSWORD; `shop all` makes its own; on a server without
// users, any process whose services connect anonymously) creates every
// missing stream of the shop with the table's configuration
// (broker.StreamConfig), compares every field of every stream with it
// (broker.Drift) and restores what differs, logging the drift at ERROR
// with its fields and counting it.
//
// Some fields no update may change (Storage, a Mirror, Sealed, …), and
// nats-server refuses the whole restore. Such a stream that holds no
// message is deleted and created again: nothing is lost, as every service
// waits for its streams to be right before it publishes or consumes
// (Service.waitForStreams), and what a stream lacks of an outbox's events
// (published into it while it was right, then removed by whoever remade
// it) the reconciler's stream audit resends. One that holds messages is
// not touched: they may be events that exist nowhere else (the outboxes
// keep theirs 72 hours). It stays drifted, the services that use it are
// not ready and say why, and an operator decides (docs/operating.md, "A
// stream the keeper cannot restore").
//
// It checks at start-up and then every streamCheckEvery (10 s), beside the
// services' own checks, and not in the reconciler's rounds: a tampered
// stream does its harm while it stays tampered (a RePublish copies every
// new event elsewhere), so the window is bounded by the check's interval,
// a minute would be six times longer; and restoring must not wait for the
// database, which the reconciler's lock needs. It costs one stream info
// request per stream per check. Copies need no turns: a create or a
// restore is idempotent, two keepers that find the same drift both restore
// the same configuration (both log it), and one deletes a stream only when
// its own restore was just refused (the other's recreated stream takes the
// update).
//
// A process without the password reports instead: each service compares
// its own stream at start-up and at each check, and logs a drift at ERROR
// once per change (not at every check), saying which variable would let it
// restore.

// streamKeeper restores (or, without the keeper's user, reports) the
// drift of streams from their configuration. One keeper restores every
// stream of the shop; a reporter is one per service, for its own stream.
type streamKeeper struct {
	js       jetstream.JetStream // the keeper's user; nil for a reporter
	wants    []jetstream.StreamConfig
	log      *slog.Logger
	repaired *prometheus.CounterVec
	drifted  *prometheus.GaugeVec

	mu     sync.Mutex
	logged map[string]string // stream → the drift last logged; absent: none
}

// newStreamKeeper returns a keeper of wants over js, the keeper's user's
// JetStream, or, with js nil, a reporter of wants that observe feeds.
func newStreamKeeper(js jetstream.JetStream, wants []jetstream.StreamConfig, log *slog.Logger) *streamKeeper {
	k := &streamKeeper{
		js:    js,
		wants: wants,
		log:   log,
		repaired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shop_stream_drift_repaired_total",
			Help: "Times the stream keeper found a stream's configuration drifted from the shop's and restored it, by stream.",
		}, []string{"stream"}),
		drifted: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "shop_stream_config_drift",
			Help: "1 while a stream's configuration differs from the shop's and is not restored (no stream keeper in this process, or the server refuses the restore), by stream.",
		}, []string{"stream"}),
		logged: map[string]string{},
	}
	// Every series from the start: an absent one is blind to rate() and
	// to alerts until the first drift.
	for _, w := range wants {
		k.repaired.WithLabelValues(w.Name)
		k.drifted.WithLabelValues(w.Name).Set(0)
	}
	return k
}

// collectors are the keeper's metrics, for one service's registry.
func (k *streamKeeper) collectors() []prometheus.Collector {
	return []prometheus.Collector{k.repaired, k.drifted}
}

// run checks at once and then every every, until ctx ends.
func (k *streamKeeper) run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		k.check(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// check creates each stream that is missing and restores each once where
// it drifted. A request that fails (JetStream unreachable, no quorum) is
// the outage the services already report, and the next check tries again.
func (k *streamKeeper) check(ctx context.Context) {
	for _, want := range k.wants {
		callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		k.keep(callCtx, want)
		cancel()
	}
}

// keep holds the stream want names to want: see check.
func (k *streamKeeper) keep(ctx context.Context, want jetstream.StreamConfig) {
	st, err := k.js.Stream(ctx, want.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if _, err := k.js.CreateStream(ctx, want); err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			k.log.Warn("stream missing; could not create it", "stream", want.Name, "err", err)
			return
		}
		// A stream made anew at start-up, or again after someone deleted
		// it: its earlier messages are gone (the stream audit resends
		// what the outboxes still hold).
		k.log.Info("stream was missing; created it with the shop's configuration", "stream", want.Name)
		return
	}
	var drift []broker.FieldDrift
	if err == nil {
		_, drift, err = broker.RestoreStream(ctx, k.js, st, want)
	}
	var apiErr *jetstream.APIError
	switch {
	case err != nil && len(drift) > 0 && errors.As(err, &apiErr):
		// JetStream refused to change the stream back: a field no update
		// may revert (Storage, Sealed, a Mirror, TTLs, …).
		k.unrestorable(ctx, want, drift, err)
	case err != nil:
		k.log.Debug("stream not checked", "stream", want.Name, "err", err)
	case len(drift) > 0:
		k.repaired.WithLabelValues(want.Name).Inc()
		k.drifted.WithLabelValues(want.Name).Set(0)
		k.forget(want.Name)
		k.log.Error("stream configuration had drifted from the shop's; restored it", "stream", want.Name,
			"fields", broker.DriftFields(drift), "drift", driftStrings(drift))
	default:
		k.drifted.WithLabelValues(want.Name).Set(0)
		k.forget(want.Name)
	}
}

// unrestorable handles a stream whose drift the server refused to undo
// (refused): deleted and created again when it holds no message, else left
// as it is and reported (see the package's comment above).
func (k *streamKeeper) unrestorable(ctx context.Context, want jetstream.StreamConfig, drift []broker.FieldDrift, refused error) {
	// Looked up again right before the delete: the drift and the count are
	// those of now, not of the check's start.
	st, err := k.js.Stream(ctx, want.Name)
	if err != nil {
		return // gone, or unreachable: the next check sees
	}
	info := st.CachedInfo()
	if drift = broker.Drift(info.Config, want); len(drift) == 0 {
		return // another keeper remade it
	}
	if info.State.Msgs == 0 {
		err := k.js.DeleteStream(ctx, want.Name)
		if err == nil || errors.Is(err, jetstream.ErrStreamNotFound) {
			_, err = k.js.CreateStream(ctx, want)
		}
		if err == nil || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			k.repaired.WithLabelValues(want.Name).Inc()
			k.drifted.WithLabelValues(want.Name).Set(0)
			k.forget(want.Name)
			k.log.Error("stream configuration differed from the shop's in fields no update may change, and the stream held no message: "+
				"deleted it and created it again with the shop's configuration", "stream", want.Name,
				"fields", broker.DriftFields(drift), "drift", driftStrings(drift))
			return
		}
		refused = fmt.Errorf("%w; deleting the empty stream to create it again: %w", refused, err)
	}
	k.drifted.WithLabelValues(want.Name).Set(1)
	k.logOnce(want.Name, drift, "stream configuration differs from the shop's, the server refuses to restore it, and the stream holds "+
		"messages: the services that use it are not ready; an operator must recreate it "+
		"(docs/operating.md, \"A stream the keeper cannot restore\")", "messages", info.State.Msgs, "err", refused)
}

// observe reports have, the configuration of the stream want names as
// the server has it: a drift at ERROR once per change, and its end.
func (k *streamKeeper) observe(want, have jetstream.StreamConfig) {
	drift := broker.Drift(have, want)
	if len(drift) == 0 {
		k.drifted.WithLabelValues(want.Name).Set(0)
		if k.forget(want.Name) {
			k.log.Info("stream configuration is the shop's again", "stream", want.Name)
		}
		return
	}
	k.drifted.WithLabelValues(want.Name).Set(1)
	k.logOnce(want.Name, drift, "stream configuration differs from the shop's; this process cannot restore it (no NATS user may "+
		"update a stream but the stream keeper): set "+broker.PasswordVar(broker.StreamsUser)+" in a process of the shop "+
		"(the order service's), and it restores the stream within "+streamCheckEvery.String())
}

// logOnce logs drift of stream at ERROR unless it is the drift logged last.
func (k *streamKeeper) logOnce(stream string, drift []broker.FieldDrift, msg string, attrs ...any) {
	text := fmt.Sprint(driftStrings(drift))
	k.mu.Lock()
	same := k.logged[stream] == text
	k.logged[stream] = text
	k.mu.Unlock()
	if !same {
		k.log.Error(msg, append([]any{"stream", stream, "fields", broker.DriftFields(drift), "drift", driftStrings(drift)}, attrs...)...)
	}
}

// forget clears the drift logged for stream and reports whether there was
// one.
func (k *streamKeeper) forget(stream string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, had := k.logged[stream]
	delete(k.logged, stream)
	return had
}

func driftStrings(drift []broker.FieldDrift) []string {
	out := make([]string, len(drift))
	for i, d := range drift {
		out[i] = d.String()
	}
	return out
}

// shopStreams is the configuration of every stream of cfg's shop, as its
// owner declares it (broker.StreamConfig with cfg's replicas and limits).
func shopStreams(cfg config.Config) []jetstream.StreamConfig {
	var wants []jetstream.StreamConfig
	for _, a := range cfg.Registry.Access() {
		wants = append(wants, broker.StreamConfig(a.Stream, cfg.NATSReplicas, cfg.StreamLimits, a.Subjects...))
	}
	return wants
}
