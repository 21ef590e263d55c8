// Package probe is what every service answers about itself: /healthz (the
// process is up) and /readyz (it can do its job, with each dependency's
// state), and the JetStream watch behind the readiness report and
// /metrics, which asks JetStream itself every 2 s.
package probe

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/httpx"
)

// Pinger is the one method of a pool that readiness needs.
type Pinger interface {
	Ping(ctx context.Context) error
}

// NewRouter returns the routes every service has: /healthz and /readyz,
// behind middlewares (chi wants them before the first route). HEAD is
// served wherever GET is, by the GET handler (net/http drops the body), as
// RFC 9110 expects and as monitors and curl -I assume; chi alone answers
// it 405.
func NewRouter(db Pinger, nc *nats.Conn, js *JetStream, middlewares ...func(http.Handler) http.Handler) chi.Router {
	r := chi.NewRouter()
	r.Use(middlewares...)
	r.Use(middleware.GetHead)
	r.Get("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	r.Get("/readyz", readyz(db, nc, js))
	return r
}

// dependency is one line of the /readyz report.
type dependency struct {
	Status string     `json:"status"`          // "up", "down", or "unknown" before the first check
	Since  *time.Time `json:"since,omitempty"` // when it went down or came up, where known
	Error  string     `json:"error,omitempty"` // why it is down
}

type readiness struct {
	Status       string                `json:"status"` // "ok" or "unavailable"
	Dependencies map[string]dependency `json:"dependencies"`
}

// readyz answers 200 when the service can do its job, which means its
// database answers. The broker is reported but does not decide: while it is
// away, business transactions still commit their events to the outbox and
// the relay publishes them when it is back. A broker that refuses the
// service's credentials does decide: that does not pass by itself, so the
// service is not ready until an operator mends it (the error says how). Two lines report it, because
// they fail apart: "nats" is the connection, "jetstream" whether JetStream
// itself answers (it may be off, without quorum or electing a leader while
// the connection is fine), with the time of its last change.
func readyz(db Pinger, nc *nats.Conn, js *JetStream) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		body := readiness{Status: "ok", Dependencies: map[string]dependency{}}
		code := http.StatusOK

		if err := db.Ping(ctx); err != nil {
			body.Dependencies["database"] = dependency{Status: "down", Error: err.Error()}
			body.Status, code = "unavailable", http.StatusServiceUnavailable
		} else {
			body.Dependencies["database"] = dependency{Status: "up"}
		}

		if st := nc.Status(); st == nats.CONNECTED {
			body.Dependencies["nats"] = dependency{Status: "up"}
		} else {
			body.Dependencies["nats"] = dependency{Status: "down", Error: "connection " + st.String()}
		}
		if js != nil {
			st := js.state()
			body.Dependencies["jetstream"] = st.dependency()
			if st.refused != nil {
				body.Dependencies["nats"] = dependency{Status: "down", Error: st.refused.Error()}
				body.Status, code = "unavailable", http.StatusServiceUnavailable
			}
		}
		if code == http.StatusServiceUnavailable {
			httpx.SetRetryAfter(w, 0)
		}
		writeJSON(w, code, body)
	}
}

func (s jetStreamState) dependency() dependency {
	switch {
	case !s.known:
		return dependency{Status: "unknown"}
	case s.up:
		return dependency{Status: "up", Since: &s.since}
	}
	return dependency{Status: "down", Since: &s.since,
		Error: fmt.Sprintf("unavailable since %s: %v", s.since.UTC().Format(time.RFC3339), s.err)}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v) // the client went away; nothing to do
}
