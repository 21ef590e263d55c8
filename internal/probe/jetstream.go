package probe

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// JetStream tells whether JetStream itself answers, which the NATS
// connection's status cannot: core NATS may be CONNECTED while JetStream is
// switched off, has lost its quorum or is electing a leader. A process asks
// every jsProbeEvery; /readyz and /metrics report the last answer. It
// decides nothing: the relay and the consumers find out for themselves and
// wait (see pkg/outbox and pkg/inbox); this is what an operator reads.
type JetStream struct {
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger

	mu      sync.Mutex
	checked bool
	up      bool
	since   time.Time // of the current state
	err     error     // why it is down
}

const jsProbeEvery = 2 * time.Second

// NewJetStream returns the watch of JetStream over nc; Run probes.
func NewJetStream(nc *nats.Conn, log *slog.Logger) (*JetStream, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream watch: %w", err)
	}
	return &JetStream{nc: nc, js: js, log: log}, nil
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

// jetStreamState is the last answer: known false before the first probe.
type jetStreamState struct {
	known, up bool
	since     time.Time
	err       error
}

func (w *JetStream) state() jetStreamState {
	w.mu.Lock()
	defer w.mu.Unlock()
	return jetStreamState{known: w.checked, up: w.up, since: w.since, err: w.err}
}

// Up reports whether JetStream answered the last probe (false before the
// first), for /metrics.
func (w *JetStream) Up() bool {
	s := w.state()
	return s.known && s.up
}
