// Package probe is what every service answers about itself: /healthz (the
// process is up) and /readyz (it can do its job, with each dependency's
// state), and the JetStream watch behind the readiness report and
// /metrics, which asks JetStream itself every 2 s.
package probe

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/outbox"
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
func NewRouter(db Pinger, nc *nats.Conn, js *JetStream, relay *Relay, middlewares ...func(http.Handler) http.Handler) chi.Router {
	r := chi.NewRouter()
	r.Use(middlewares...)
	r.Use(middleware.GetHead)
	r.Get("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	r.Get("/readyz", readyz(db, nc, js, relay))
	return r
}

// Relay is what /readyz reads of the service's outbox relay: its "relay"
// line. Nil: no line.
type Relay struct {
	// Var is the variable that sets the service's relay mode
	// (ORDER_RELAY_MODE), named when CDC is unavailable.
	Var string
	// State is the relay's (outbox.Relay.State).
	State func() outbox.State
	// DB reads the slot (outbox.ReadSlot) in cdc mode or while it exists.
	DB outbox.DB
	// DropSlot is the command that drops the slot (shop slots drop
	// --service order), named for a slot left by cdc mode; default: a
	// call of outbox.DropSlot.
	DropSlot string
}

// dependency is one line of the /readyz report.
type dependency struct {
	Status string     `json:"status"`          // "up", "down", or "unknown" before the first check; the relay's: "streaming", "standby" or "polling"
	Since  *time.Time `json:"since,omitempty"` // when it went down or came up, where known
	Error  string     `json:"error,omitempty"` // why it is down; the relay's: why it does not do what its mode says, or its slot is in danger
	Mode   string     `json:"mode,omitempty"`  // the relay's: poll or cdc
	Slot   *SlotLine  `json:"slot,omitempty"`  // the relay's slot, in cdc mode or while it exists
}

// SlotLine is the relay's replication slot in /readyz: what the
// dashboard shows of it.
type SlotLine struct {
	Name          string  `json:"name"`
	Active        bool    `json:"active"`
	WALStatus     string  `json:"wal_status"` // reserved, extended, unreserved, lost; empty: no slot (yet)
	LagBytes      int64   `json:"lag_bytes"`
	LagAgeSeconds float64 `json:"lag_age_seconds"`
	SafeWALBytes  int64   `json:"safe_wal_size_bytes"` // -1: no limit
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
// service is not ready until an operator mends it (the error says how). So
// does a stream of the service whose configuration differs from the
// shop's ("streams", set by the service: JetStream.SetStream): it may drop
// the service's events or bring in events nobody published, and the
// service is not ready until the stream keeper, or an operator, makes it
// right. Two lines report the broker, because
// they fail apart: "nats" is the connection, "jetstream" whether JetStream
// itself answers (it may be off, without quorum or electing a leader while
// the connection is fine), with the time of its last change.
//
// The relay does not decide either: a relay in cdc mode that the database
// cannot serve (a setting, a privilege) polls the table, so events still
// flow; its line says why and which setting to mend, and a slot whose WAL
// is no longer kept (wal_status unreserved or lost) says it too.
func readyz(db Pinger, nc *nats.Conn, js *JetStream, relay *Relay) http.HandlerFunc {
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
			if d, blocks := st.streamsLine(); d != nil {
				body.Dependencies["streams"] = *d
				if blocks {
					body.Status, code = "unavailable", http.StatusServiceUnavailable
				}
			}
		}
		if relay != nil {
			body.Dependencies["relay"] = relay.dependency(ctx)
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

// streamsLine is the "streams" line of /readyz, nil before the service
// looked its streams up: "up" when each is as the shop wants, else "down"
// with what is wrong with each, and whether that makes the service not
// ready (StreamState.Blocks).
func (s jetStreamState) streamsLine() (*dependency, bool) {
	if len(s.streams) == 0 {
		return nil, false
	}
	var problems []string
	blocks := false
	for _, name := range slices.Sorted(maps.Keys(s.streams)) {
		if st := s.streams[name]; st.Problem != "" {
			problems = append(problems, name+": "+st.Problem)
			blocks = blocks || st.Blocks
		}
	}
	if len(problems) == 0 {
		return &dependency{Status: "up"}, false
	}
	return &dependency{Status: "down", Error: strings.Join(problems, "; ")}, blocks
}

// dependency is the relay's line of /readyz.
func (r *Relay) dependency(ctx context.Context) dependency {
	st := r.State()
	d := dependency{Mode: string(st.Mode), Status: "polling"}
	var problems []string
	if st.Mode == outbox.ModeCDC {
		switch {
		case st.Streaming:
			d.Status = "streaming"
		case st.CDCUnavailable != "":
			problems = append(problems, fmt.Sprintf("cdc unavailable, polling the outbox table and retrying cdc every 10s: %s (or set %s=poll)",
				st.CDCUnavailable, r.Var))
		default:
			d.Status = "standby" // another copy streams the slot, or this one is about to
		}
	}
	ss, err := outbox.ReadSlot(ctx, r.DB, st.Slot)
	switch {
	case err != nil:
		problems = append(problems, err.Error())
	case ss.Exists || st.Mode == outbox.ModeCDC:
		d.Slot = &SlotLine{Name: ss.Slot, Active: ss.Active, WALStatus: ss.WALStatus, LagBytes: ss.LagBytes,
			LagAgeSeconds: ss.LagAge.Seconds(), SafeWALBytes: ss.SafeWALSize}
		problems = append(problems, slotProblems(ss, st.Mode, r.Var, r.DropSlot)...)
	}
	d.Error = strings.Join(problems, "; ")
	return d
}

// slotProblems says what is wrong with the relay's slot: WAL the server no
// longer keeps for it (wal_status unreserved or lost), or a slot that pins
// WAL though the relay polls.
func slotProblems(ss outbox.SlotStats, mode outbox.Mode, modeVar, dropSlot string) []string {
	var problems []string
	switch ss.WALStatus {
	case "lost":
		problems = append(problems, fmt.Sprintf("slot %s wal_status lost: the server removed WAL it had not confirmed "+
			"(max_slot_wal_keep_size); the relay recreates it and backfills from the outbox table", ss.Slot))
	case "unreserved":
		problems = append(problems, fmt.Sprintf("slot %s wal_status unreserved: it holds more WAL than max_slot_wal_keep_size "+
			"and is lost at the next checkpoint unless its relay catches up", ss.Slot))
	}
	if ss.Exists && mode == outbox.ModePoll && !ss.Active {
		if dropSlot == "" {
			dropSlot = "outbox.DropSlot"
		}
		problems = append(problems, fmt.Sprintf("slot %s exists but the relay polls: it holds %d bytes of WAL that no relay confirms; "+
			"drop it (%s) or set %s=cdc", ss.Slot, ss.RestartLagBytes, dropSlot, modeVar))
	}
	return problems
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v) // the client went away; nothing to do
}
