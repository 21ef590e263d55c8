// Package dashboard serves the shop's live web page: orders moving through
// the saga's states (each card with its customer, items, total in euros and,
// when CLOSED or REJECTED, the reason), each service's outbox backlog, the
// latest published events and the open dead letters, with buttons that place
// a demo order and pay it. Clicking an order opens its journey
// (ops/journey) as a waterfall on a time axis: a bar per event from its
// commit to its publish, a bar per consumer from the publish to its
// processing, and the saga's state changes as marks; the same entries, with
// the time each hop took, fold out as a table.
//
// It is an operator's view, like `shop verify`: it reads every service's
// schema directly, read-only, for display. To act it goes through the
// services' public HTTP APIs only, exactly as a client would, so what the
// page shows is the system's own behaviour and not a shortcut around it.
//
// Over time it shows charts of the last minutes (Config.Window): orders
// completed per second, order → COMPLETED latency (p50, p99), each
// service's outbox backlog and each consuming service's lag, and a strip
// with every service's /readyz. Run gathers them: once a second one query
// per schema into a small ring in this process, every few seconds the
// /readyz answers; GET /api/series serves the ring. Nothing else is kept.
//
// The page is plain HTML, CSS and a little JavaScript embedded in the binary
// (no build step). Every time it prints is local, 24 h, to the millisecond
// (HH:MM:SS.mmm), as its footer says. The charts are drawn by uPlot
// (static/vendor, MIT): about 50 KB with no dependencies, served as the
// file it ships (no build step), drawing on a canvas, so ten minutes of
// samples per series cost the page little, and maintained. It follows the
// state over server-sent events and falls back to polling where those do
// not get through.
package dashboard

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/ops/journey"
)

//go:embed static
var static embed.FS

// DB is what the dashboard reads a schema through; a *pgxpool.Pool
// satisfies it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Config configures a Server.
type Config struct {
	// Services are the shop's services in the order the page lists them
	// (the registry's); a service with a pool that is not named here comes
	// after them, by name. Default: the pools' names, "order" first.
	Services []string
	// Pools holds one read pool per service, by service name ("order",
	// "inventory", …), each bound to that service's schema. "order" is
	// required: the orders are read from it.
	Pools map[string]DB
	// OrderURL and PaymentURL are the base URLs of the order and payment
	// services' public APIs ("http://127.0.0.1:8081"). Required.
	OrderURL, PaymentURL string
	// PaymentTimeout is the saga's PAYMENT_TIMEOUT, shown on the page: an
	// order that is not paid closes after it.
	PaymentTimeout time.Duration
	// Demo lets the page act: POST /api/demo/order places an order and
	// POST /api/demo/pay/{id} pays one (with CanPay). Off, the default, the
	// dashboard only reads and those paths do not exist (404): an endpoint
	// that orders for anyone who reaches it is a demo's convenience, never
	// an operator's view (`shop all -demo`, DASHBOARD_DEMO).
	Demo bool
	// CanPay says the payment service serves POST /payments/{id}/simulate
	// (its fake provider is on, PAYMENT_FAKE_PROVIDER; `shop all -demo`).
	// Only then, and with Demo, does the page offer "Pay"; with Demo but
	// without it POST /api/demo/pay answers 409 and says why.
	CanPay bool
	// Hosts are the names, besides localhost, 127.0.0.1 and ::1, that the
	// dashboard answers to in a request's Host header (without the port):
	// the host it listens on, when that is a name or an address of its
	// own, and the names an operator reaches it by (DASHBOARD_HOSTS). Any
	// other Host is refused with 421, which is what defeats DNS rebinding
	// (guard.go).
	Hosts []string
	// Interval is how often the server-sent events push the state (default
	// 1s).
	Interval time.Duration
	// ServiceURLs are the base URLs of every service's API, by name, whose
	// GET /readyz the health strip shows. Default: the order and payment
	// services', from OrderURL and PaymentURL.
	ServiceURLs map[string]string
	// Consumers are the shop's inbox consumers, whose lag the charts plot
	// per consuming service. Default: none, and no lag chart.
	Consumers []Consumer
	// TraceUIURL, when set, links each order to its trace: a URL template
	// where "{trace_id}" stands for the trace id, such as
	// "http://localhost:16686/trace/{trace_id}" for Jaeger (TRACE_UI_URL).
	// The id is the one the order's first event was written under (the
	// traceparent its outbox row keeps). Empty, the default: no links.
	TraceUIURL string
	// SampleInterval is how often Run samples the charts (default 1s),
	// HealthInterval how often it asks every /readyz (default 3s), and
	// Window how far back the charts go (default 10m).
	SampleInterval, HealthInterval, Window time.Duration
	// Client calls the services (default: a client with a 10s timeout).
	Client *http.Client
	// Logger logs failed reads and calls (default: discard).
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if len(c.Services) == 0 {
		c.Services = []string{"order"}
	}
	c.Interval = cmp.Or(c.Interval, time.Second)
	if c.Client == nil {
		c.Client = &http.Client{Timeout: 10 * time.Second}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.OrderURL = strings.TrimRight(c.OrderURL, "/")
	c.PaymentURL = strings.TrimRight(c.PaymentURL, "/")
	if c.ServiceURLs == nil {
		c.ServiceURLs = map[string]string{"order": c.OrderURL, "payment": c.PaymentURL}
	}
	c.SampleInterval = cmp.Or(c.SampleInterval, time.Second)
	c.HealthInterval = cmp.Or(c.HealthInterval, 3*time.Second)
	c.Window = cmp.Or(c.Window, 10*time.Minute)
}

func (c *Config) validate() error {
	switch {
	case c.Pools["order"] == nil:
		return errors.New("dashboard: Pools must hold the order service's pool")
	case c.OrderURL == "" || c.PaymentURL == "":
		return errors.New("dashboard: OrderURL and PaymentURL are required")
	case c.TraceUIURL != "" && !strings.Contains(c.TraceUIURL, "{trace_id}"):
		return fmt.Errorf("dashboard: TraceUIURL %q has no {trace_id} to put the trace id in", c.TraceUIURL)
	}
	for _, h := range c.Hosts {
		if hostName(h) == "" || strings.ContainsAny(h, "/ ") {
			return fmt.Errorf("dashboard: Hosts: %q is not a host name (want one such as shop.example.com, without scheme or path)", h)
		}
	}
	return nil
}

// Server is the dashboard's HTTP handler. It is safe for concurrent use.
type Server struct {
	cfg      Config
	services []string // the pools' names, in the order the page lists them
	journeys map[string]journey.DB
	hosts    []string // the Host names served (hostName), loopback's included
	handler  http.Handler

	// The state is read at most once per half interval, however many pages
	// are open, so each extra viewer costs the databases nothing.
	mu     sync.Mutex
	cached State
	readAt time.Time

	// What Run gathers: the charts' ring and the last health checks.
	seriesMu sync.Mutex
	sampler  sampler
	health   []Health
}

// New returns a dashboard configured by cfg. It does no I/O.
func New(cfg Config) (*Server, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Server{
		cfg:      cfg,
		services: serviceNames(cfg.Pools, cfg.Services),
		journeys: make(map[string]journey.DB, len(cfg.Pools)),
		hosts:    slices.Clone(loopback),
	}
	for _, h := range cfg.Hosts {
		s.hosts = append(s.hosts, hostName(h))
	}
	s.sampler.ring = make([]Sample, max(1, int(cfg.Window/cfg.SampleInterval)))
	s.sampler.failing, s.sampler.read = map[string]error{}, map[string]bool{}
	for name, db := range cfg.Pools {
		s.journeys[name] = db
	}
	files, _ := fs.Sub(static, "static") // static is embedded: cannot fail
	mux := http.NewServeMux()
	mux.Handle("GET /{$}", http.FileServerFS(files))
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(files)))
	mux.HandleFunc("GET /api/state", s.handleState)
	mux.HandleFunc("GET /api/events", s.handleEvents)
	mux.HandleFunc("GET /api/series", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, http.StatusOK, s.series()) })
	mux.HandleFunc("GET /api/orders/{id}/journey", s.handleJourney)
	if cfg.Demo {
		mux.HandleFunc("POST /api/demo/order", s.handleOrder)
		mux.HandleFunc("POST /api/demo/pay/{id}", s.handlePay)
	}
	s.handler = s.guard(mux)
	return s, nil
}

// ServeHTTP serves the page and its API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// state returns the state, read afresh unless a read of the last half
// interval can serve.
func (s *Server) state(ctx context.Context) (State, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if time.Since(s.readAt) < s.cfg.Interval/2 {
		return s.cached, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := s.readState(ctx)
	if err != nil {
		return State{}, err
	}
	s.cached, s.readAt = st, time.Now()
	return st, nil
}

func (s *Server) handleState(w http.ResponseWriter, r *http.Request) {
	st, err := s.state(r.Context())
	if err != nil {
		s.cfg.Logger.Warn("dashboard state not read", "err", err)
		unavailable(w, err)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

// unavailable answers 503 for a read the databases did not answer, with
// Retry-After, as every 503 of the shop: the page asks again by itself.
func unavailable(w http.ResponseWriter, err error) {
	httpx.SetRetryAfter(w, 0)
	writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": err.Error() + "; the databases did not answer, ask again after Retry-After seconds"})
}

// handleJourney answers with the journey of order {id} (journey.Load): 400
// for an id that is not a UUID, 404 for an order no schema knows.
func (s *Server) handleJourney(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "order id must be a UUID"})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	j, err := journey.Load(ctx, s.journeys, id)
	switch {
	case errors.Is(err, journey.ErrNotFound):
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no order " + id.String()})
	case err != nil:
		s.cfg.Logger.Warn("dashboard journey not read", "order_id", id, "err", err)
		unavailable(w, err)
	default:
		writeJSON(w, http.StatusOK, j)
	}
}

// handleEvents pushes the state every interval as a server-sent event until
// the client goes away or the server stops (the request's context ends). A
// failed read becomes a "problem" event (not "error", which EventSource
// uses for a broken connection), and the stream carries on.
func (s *Server) handleEvents(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Accel-Buffering", "no") // a proxy in front must not buffer the stream
	w.WriteHeader(http.StatusOK)
	tick := time.NewTicker(s.cfg.Interval)
	defer tick.Stop()
	for {
		event, data := "", []byte(nil)
		st, err := s.state(r.Context())
		if err != nil {
			if r.Context().Err() != nil {
				return
			}
			s.cfg.Logger.Warn("dashboard state not read", "err", err)
			event, data = "event: problem\n", mustJSON(map[string]string{"error": err.Error()})
		} else {
			data = mustJSON(st)
		}
		if _, err := fmt.Fprintf(w, "%sdata: %s\n\n", event, data); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-tick.C:
		}
	}
}

// handleOrder places a demo order, one unit of SKU-1, through the order
// service's POST /orders, and answers with the service's own response. The
// fresh Idempotency-Key makes each click a new order; the service still
// dedups a retry of one request.
func (s *Server) handleOrder(w http.ResponseWriter, r *http.Request) {
	var b [8]byte
	_, _ = rand.Read(b[:])
	body := `{"customer_id":"dashboard","items":[{"sku":"SKU-1","quantity":1}]}`
	s.forward(w, r, s.cfg.OrderURL+"/orders", body, map[string]string{"Idempotency-Key": "dashboard-" + hex.EncodeToString(b[:])})
}

// handlePay pays order {id} through the payment service's fake provider
// (POST /payments/{id}/simulate, outcome succeeded), once: the dashboard
// shows the Pay button when the order says WAIT_PAY, and from that instant
// payment takes the money (the order waits for payment's PaymentOpened
// before it says so).
func (s *Server) handlePay(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.CanPay {
		writeJSON(w, http.StatusConflict, map[string]string{"error": "the payment service's fake provider is off: " +
			"run `shop all -demo`, or set PAYMENT_FAKE_PROVIDER=true, to pay from here"})
		return
	}
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "order id must be a UUID"})
		return
	}
	s.forward(w, r, s.cfg.PaymentURL+"/payments/"+id.String()+"/simulate", `{"outcome":"succeeded"}`, nil)
}

// forward POSTs body to url and copies the answer to w.
func (s *Server) forward(w http.ResponseWriter, r *http.Request, url, body string, header map[string]string) {
	status, h, b, err := s.call(r.Context(), url, body, header)
	s.reply(w, url, status, h, b, err)
}

func (s *Server) call(ctx context.Context, url, body string, header map[string]string) (int, http.Header, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := s.cfg.Client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	return res.StatusCode, res.Header, b, err
}

// reply writes a service's answer, or a 502 when it could not be had.
func (s *Server) reply(w http.ResponseWriter, url string, status int, header http.Header, body []byte, err error) {
	if err != nil {
		s.cfg.Logger.Warn("dashboard call failed", "url", url, "err", err)
		writeJSON(w, http.StatusBadGateway, map[string]string{"error": fmt.Sprintf("POST %s: %v", url, err)})
		return
	}
	w.Header().Set("Content-Type", cmp.Or(header.Get("Content-Type"), "application/json"))
	w.WriteHeader(status)
	_, _ = io.Copy(w, bytes.NewReader(body))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(mustJSON(v))
}

// mustJSON encodes v, which is always one of this package's plain types.
func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
