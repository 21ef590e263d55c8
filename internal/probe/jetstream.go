package probe

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
)

// JetStream tells whether JetStream itself answers, which the NATS
// connection's status cannot: core NATS may be CONNECTED while JetStream is
// switched off, has lost its quorum or is electing a leader. A process asks
// every jsProbeEvery; /readyz and /metrics report the last answer. It
// decides nothing: the relay and the consumers find out for themselves and
// wait (see pkg/outbox and pkg/inbox); this is what an operator reads.
//
// It also tells whether the server refuses the service's credentials, which
// no amount of waiting mends: a deployed server whose auth.conf lacks the
// service's user, or a password that differs from the server's. That is
// logged at ERROR with the fix, and /readyz is not ready while it lasts.
type JetStream struct {
	nc      *nats.Conn
	js      jetstream.JetStream
	log     *slog.Logger
	service string // whose connection: its NATS user and <NAME>_NATS_PASSWORD

	mu      sync.Mutex
	checked bool
	up      bool
	since   time.Time // of the current state
	err     error     // why it is down
	refused error     // why the server refuses the credentials; nil once it accepts them

	streams map[string]StreamState // the service's streams, as it last looked them up (SetStream)
}

// StreamState is what a service last found of one of its streams.
type StreamState struct {
	// Problem says what is wrong with it; empty: it is as the shop wants.
	Problem string
	// Blocks: the service is not ready while it lasts. A stream whose
	// configuration differs from the shop's blocks (it may drop events, or
	// bring in events no service published); a missing one does not, like a
	// broker outage: the stream keeper creates it, and the outbox holds the
	// events until then.
	Blocks bool
}

// SetStream records what the service found of stream, for /readyz.
func (w *JetStream) SetStream(stream string, st StreamState) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.streams == nil {
		w.streams = map[string]StreamState{}
	}
	w.streams[stream] = st
}

const jsProbeEvery = 2 * time.Second

// NewJetStream returns the watch of JetStream over the connection nc of
// service; Run probes.
func NewJetStream(nc *nats.Conn, service string, log *slog.Logger) (*JetStream, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream watch: %w", err)
	}
	return &JetStream{nc: nc, js: js, log: log, service: service}, nil
}

// Run probes until ctx ends.
func (w *JetStream) Run(ctx context.Context) {
	t := time.NewTicker(jsProbeEvery)
	defer t.Stop()
	for {
		w.probe(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (w *JetStream) probe(ctx context.Context) {
	w.checkCredentials()
	var err error
	if st := w.nc.Status(); st != nats.CONNECTED {
		err = fmt.Errorf("nats connection %s", st)
	} else {
		pctx, cancel := context.WithTimeout(ctx, jsProbeEvery)
		_, err = w.js.AccountInfo(pctx)
		cancel()
	}
	if ctx.Err() != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	up := err == nil
	changed := !w.checked || up != w.up
	w.err = err
	if !changed {
		return
	}
	now := time.Now()
	switch {
	case !up:
		w.log.Warn("jetstream unavailable", "err", err)
	case w.checked:
		w.log.Info("jetstream available again", "down_for", now.Sub(w.since).Round(time.Millisecond))
	}
	w.checked, w.up, w.since = true, up, now
}

// checkCredentials notes whether the server refused the connection's
// credentials at its last attempt (the client keeps trying, connectNATS),
// and logs each change. Only a connection clears it: while the server is
// unreachable the refusal stands.
func (w *JetStream) checkCredentials() {
	var refused error
	switch st, last := w.nc.Status(), w.nc.LastError(); {
	case st == nats.CONNECTED:
	case errors.Is(last, nats.ErrAuthorization):
		v := broker.PasswordVar(w.service)
		refused = fmt.Errorf("the NATS server refuses user %s (%v): it has no such user or another password; "+
			"regenerate deploy/nats/auth.conf from the registry (go test ./internal/broker -run TestAuthConfMatchesTheTable -update), "+
			"give the server %s and reload it, and set %s for this service to the same password", w.service, last, v, v)
	default:
		w.mu.Lock()
		refused = w.refused
		w.mu.Unlock()
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case refused != nil && w.refused == nil:
		w.log.Error("nats authentication failed: the server refuses this service's credentials", "nats_user", w.service, "err", refused)
	case refused == nil && w.refused != nil:
		w.log.Info("nats authentication succeeded: the server accepts this service's credentials again", "nats_user", w.service)
	}
	w.refused = refused
}

// jetStreamState is the last answer: known false before the first probe.
type jetStreamState struct {
	known, up bool
	since     time.Time
	err       error
	refused   error // the server refuses the credentials (checkCredentials)
	streams   map[string]StreamState
}

func (w *JetStream) state() jetStreamState {
	w.mu.Lock()
	defer w.mu.Unlock()
	return jetStreamState{known: w.checked, up: w.up, since: w.since, err: w.err, refused: w.refused, streams: maps.Clone(w.streams)}
}

// Up reports whether JetStream answered the last probe (false before the
// first), for /metrics.
func (w *JetStream) Up() bool {
	s := w.state()
	return s.known && s.up
}
