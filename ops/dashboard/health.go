package dashboard

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// Health is one service's answer to GET /readyz, as the page's health strip
// shows it.
type Health struct {
	Service string `json:"service"`
	// OK is true when /readyz answered 200: the service can do its job.
	OK bool `json:"ok"`
	// Detail is the answer in words: each dependency's status ("database
	// up · nats up · jetstream up") and, when down, why; or why /readyz
	// could not be read at all.
	Detail string `json:"detail"`
	// At is when it was asked; zero before the first check.
	At time.Time `json:"at"`
	// Relay is the "relay" line of /readyz: how the service's outbox
	// relay finds its events and how far its replication slot lags; nil
	// when the service does not report it.
	Relay *RelayHealth `json:"relay,omitempty"`
}

// RelayHealth is a service's outbox relay as its /readyz reports it
// (internal/probe).
type RelayHealth struct {
	Mode   string `json:"mode"`   // poll or cdc
	Status string `json:"status"` // streaming, standby or polling
	Error  string `json:"error,omitempty"`
	// Slot is the relay's replication slot, in cdc mode or while it
	// exists: the WAL it makes the database keep.
	Slot *struct {
		Name          string  `json:"name"`
		Active        bool    `json:"active"`
		WALStatus     string  `json:"wal_status"`
		LagBytes      int64   `json:"lag_bytes"`
		LagAgeSeconds float64 `json:"lag_age_seconds"`
		SafeWALBytes  int64   `json:"safe_wal_size_bytes"`
	} `json:"slot,omitempty"`
}

// readiness is the body of a service's /readyz (cmd/shop/app).
type readiness struct {
	Status       string `json:"status"`
	Dependencies map[string]struct {
		Status string `json:"status"`
		Error  string `json:"error"`
	} `json:"dependencies"`
}

// relayReadiness is the relay's line of a /readyz body, read apart for its
// mode and slot.
type relayReadiness struct {
	Dependencies struct {
		Relay *RelayHealth `json:"relay"`
	} `json:"dependencies"`
}

// checkHealth asks every service of Config.ServiceURLs for /readyz at once,
// each within a short timeout, so one hung service delays the strip by at
// most that and says so.
func (s *Server) checkHealth(ctx context.Context) []Health {
	names := serviceNames(s.cfg.ServiceURLs, s.cfg.Services)
	out := make([]Health, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Go(func() {
			ok, detail, relay := s.readyz(ctx, s.cfg.ServiceURLs[name])
			out[i] = Health{Service: name, OK: ok, Detail: detail, At: time.Now(), Relay: relay}
		})
	}
	wg.Wait()
	return out
}

func (s *Server) readyz(ctx context.Context, base string) (bool, string, *RelayHealth) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	url := strings.TrimRight(base, "/") + "/readyz"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false, err.Error(), nil
	}
	res, err := s.cfg.Client.Do(req)
	if err != nil {
		return false, fmt.Sprintf("GET %s: %v", url, err), nil
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(res.Body, 64<<10))
	var r readiness
	if json.Unmarshal(b, &r) != nil || len(r.Dependencies) == 0 {
		return res.StatusCode == http.StatusOK, res.Status, nil
	}
	var rr relayReadiness
	_ = json.Unmarshal(b, &rr) // it parsed as readiness just now
	deps := make([]string, 0, len(r.Dependencies))
	for name := range r.Dependencies {
		deps = append(deps, name)
	}
	slices.Sort(deps)
	parts := make([]string, 0, len(deps))
	for _, name := range deps {
		d := r.Dependencies[name]
		part := name + " " + d.Status
		if d.Error != "" {
			part += " (" + d.Error + ")"
		}
		parts = append(parts, part)
	}
	return res.StatusCode == http.StatusOK, strings.Join(parts, " · "), rr.Dependencies.Relay
}
