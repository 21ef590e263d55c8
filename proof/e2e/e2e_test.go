// Package e2e runs the whole shop — the four services as `shop all` runs
// them, against real Postgres and a real NATS server — and drives it through
// the public HTTP API only. Every test ends with the contract's invariants
// checked by the same code as `shop verify`.
package e2e

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/apitest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

const (
	// paymentTimeout is PAYMENT_TIMEOUT: long enough that a customer who
	// pays the instant WAIT_PAY shows reaches the payment service before
	// pay_by on a machine running make test beside another shop's load
	// (at 8s, 2 of 40 such webhooks arrived after it, a payment service
	// answering that late).
	paymentTimeout = 15 * time.Second
	// captureGrace is PAYMENT_CAPTURE_GRACE: an unpaid order closes this
	// long after its pay_by. Shorter than the default (30s) to keep the
	// suite short, long enough that a payment made in time on a loaded
	// machine is still decided in time.
	captureGrace  = 15 * time.Second
	webhookSecret = "e2e-secret"
	operatorToken = "e2e-operator-token"
)

// shop is the running system every test in the package talks to.
var shop struct {
	order, inventory, payment, fulfillment string // base URLs
	nats                                   *natstest.Server
	pools                                  struct{ Order, Inventory, Payment, Fulfillment *pgxpool.Pool }
	checked                                verify.Shop                 // what shop verify reads
	js                                     jetstream.JetStream         // the shop's broker, for the stream audit
	spans                                  *tracetest.InMemoryExporter // every service's spans
	// api checks every response a test receives against api/openapi.yaml
	// (http.DefaultTransport is wrapped; a client of its own wraps its
	// transport with api.Transport).
	api *apitest.Checker
}

// documentedStatuses are the statuses the suite must have seen, each
// checked against api/openapi.yaml at least once, when it runs whole.
var documentedStatuses = []int{200, 201, 202, 400, 401, 404, 409, 413, 415, 422, 503}

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) (code int) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var err error
	if shop.api, err = apitest.New(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	http.DefaultTransport = shop.api.Transport(http.DefaultTransport)
	defer func() {
		// The round trip's error already failed the request's test;
		// this also catches requests whose caller ignores errors.
		if bad := shop.api.Mismatches(); len(bad) > 0 {
			fmt.Fprintf(os.Stderr, "e2e: %d responses do not match api/openapi.yaml:\n  %s\n", len(bad), strings.Join(bad, "\n  "))
			code = 1
		}
	}()

	// A throwaway database: the services use their fixed schema names.
	db, err := pgtest.CreateDatabase(ctx, "shop_e2e_")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e database:", err)
		return 1
	}
	defer func() {
		if err := db.Drop(context.Background()); err != nil {
			fmt.Fprintln(os.Stderr, "e2e database:", err)
		}
	}()
	dbURL := db.URL

	// The shop's own NATS users, as deploy/nats/auth.conf has them: every
	// test here runs with the services' permissions on.
	srv, passwords := natstest.NewSecured(&mainTB{}, services.All.Access())
	defer srv.Stop()
	shop.nats = srv

	env := map[string]string{
		"DATABASE_URL":           dbURL,
		"NATS_URL":               srv.URL(),
		"PAYMENT_TIMEOUT":        paymentTimeout.String(),
		"PAYMENT_CAPTURE_GRACE":  captureGrace.String(),
		"PAYMENT_WEBHOOK_SECRET": webhookSecret,
		// The demo's endpoint is served (the tests pay through it), and the
		// operator's endpoints want their token, as in a real deployment.
		"PAYMENT_FAKE_PROVIDER": "true",
		"OPERATOR_TOKEN":        operatorToken,
		// Short enough to be armed and cancelled on every order here, long
		// enough that no order of a busy test waits for inventory that long.
		"ORDER_RESERVATION_TIMEOUT": "1m",
		"FULFILLMENT_DELAY":         "200ms",
		"DASHBOARD_ADDR":            freeAddr(), // not the machine's :8080
	}
	// RELAY_MODE=cdc go test ./proof/e2e runs the whole suite with
	// every relay in that mode; unset, the shop's default.
	if mode := os.Getenv("RELAY_MODE"); mode != "" {
		env["RELAY_MODE"] = mode
	}
	for _, name := range services.All.Names() {
		env[strings.ToUpper(name)+"_ADDR"] = freeAddr()
		env[broker.PasswordVar(name)] = passwords[name]
	}
	env[broker.PasswordVar(broker.AuditUser)] = passwords[broker.AuditUser]
	env[broker.PasswordVar(broker.StreamsUser)] = passwords[broker.StreamsUser]
	cfg, err := config.LoadFor(services.All, func(k string) string { return env[k] })
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if shop.spans, err = traceServices(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	// The shop's warnings and errors are kept, and their tail printed when
	// a test fails: a flake's cause (a stream that ended and restarted, an
	// outage) is there, and CI shows nothing else of the shop.
	warnings := &logTail{max: 64 << 10}
	var h slog.Handler = slog.NewTextHandler(warnings, &slog.HandlerOptions{Level: slog.LevelWarn})
	if os.Getenv("E2E_LOG") != "" {
		h = slog.NewTextHandler(os.Stderr, nil)
	}
	violations := violationCounter{h, new(atomic.Int64)}
	log := slog.New(violations)
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, cfg, cfg.Registry.Names(), log) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			fmt.Fprintln(os.Stderr, "shop:", err)
		}
	}()

	url := func(name string) string { return "http://" + env[strings.ToUpper(name)+"_ADDR"] }
	shop.order, shop.inventory, shop.payment, shop.fulfillment = url("order"), url("inventory"), url("payment"), url("fulfillment")
	ready, stopWaiting := context.WithTimeout(ctx, 30*time.Second)
	defer stopWaiting()
	for _, base := range []string{shop.order, shop.inventory, shop.payment, shop.fulfillment} {
		if err := httpx.WaitReady(ready, nil, base); err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			return 1
		}
	}
	checked, closePools, err := app.OpenShop(ctx, cfg.Schemas(), 2)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer closePools()
	shop.checked = checked
	shop.pools.Order, shop.pools.Inventory = checked.Pools["order"], checked.Pools["inventory"]
	shop.pools.Payment, shop.pools.Fulfillment = checked.Pools["payment"], checked.Pools["fulfillment"]
	// The stream audit reads as the operator does.
	nc, err := nats.Connect(srv.URL(), broker.UserOptions(broker.AuditUser, passwords[broker.AuditUser])...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer nc.Close()
	if shop.js, err = jetstream.New(nc); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	code = m.Run()
	if code != 0 {
		fmt.Fprintf(os.Stderr, "e2e: a test failed; the shop's last warnings and errors (E2E_LOG=1 shows its whole log):\n%s\n", warnings)
	}
	// Every test ran with the services' permissions on: a service that
	// needed what its NATS user may not do shows here, not as a slow test.
	if n := violations.n.Load(); n > 0 {
		fmt.Fprintf(os.Stderr, "e2e: the shop logged %d NATS permissions violations (E2E_LOG=1 shows them)\n", n)
		return 1
	}
	if code != 0 {
		return code
	}
	// The validation is only as good as the responses it saw: the whole
	// suite must have produced every status it claims to check.
	if f := flag.Lookup("test.run"); f != nil && f.Value.String() != "" {
		return code // a subset ran: it need not produce them all
	}
	seen := shop.api.Statuses()
	fmt.Fprintf(os.Stderr, "e2e: responses checked against api/openapi.yaml, by status: %v\n", seen)
	if missing := shop.api.Missing(documentedStatuses...); len(missing) > 0 {
		fmt.Fprintf(os.Stderr, "e2e: no test produced a response with status %v, so api/openapi.yaml was not checked for it\n", missing)
		return 1
	}
	return code
}

// logTail keeps the last max bytes written to it, whole lines.
type logTail struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (l *logTail) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	if over := len(l.buf) - l.max; over > 0 {
		cut := over
		if i := bytes.IndexByte(l.buf[over:], '\n'); i >= 0 {
			cut = over + i + 1
		}
		l.buf = append(l.buf[:0], l.buf[cut:]...)
	}
	return len(p), nil
}

func (l *logTail) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.buf)
}

// violationCounter counts the shop's "nats permissions violation" records,
// into one count shared by the handlers derived from it (log.With).
type violationCounter struct {
	slog.Handler
	n *atomic.Int64
}

func (c violationCounter) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "nats permissions violation" {
		c.n.Add(1)
	}
	return c.Handler.Handle(ctx, r)
}

func (c violationCounter) WithAttrs(attrs []slog.Attr) slog.Handler {
	return violationCounter{c.Handler.WithAttrs(attrs), c.n}
}

func (c violationCounter) WithGroup(name string) slog.Handler {
	return violationCounter{c.Handler.WithGroup(name), c.n}
}

// checkInvariants waits until the shop is quiet and every invariant holds,
// the streams' audit against the outboxes included.
func checkInvariants(t *testing.T) {
	t.Helper()
	checkInvariantsWithin(t, 30*time.Second)
}

// checkInvariantsWithin is checkInvariants giving the shop up to quiet to
// become quiet: longer after a test that loaded it.
func checkInvariantsWithin(t *testing.T, quiet time.Duration) {
	t.Helper()
	report, err := verify.Wait(context.Background(), shop.checked, 72*time.Hour, quiet, verify.WithStreams(shop.js))
	if err != nil {
		t.Fatal(err)
	}
	if !report.OK() {
		var b strings.Builder
		report.Write(&b)
		t.Fatalf("invariants violated:\n%s", b.String())
	}
}

// ---- HTTP helpers ----

type response struct {
	status int
	header http.Header
	body   map[string]any
	raw    string
}

func do(t *testing.T, method, url string, header map[string]string, body any) response {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		js, _ := json.Marshal(b)
		rd = bytes.NewReader(js)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	raw, _ := io.ReadAll(res.Body)
	r := response{status: res.StatusCode, header: res.Header, raw: string(raw)}
	_ = json.Unmarshal(raw, &r.body)
	return r
}

func restock(t *testing.T, sku string, onHand, price int) {
	t.Helper()
	r := do(t, "PUT", shop.inventory+"/stock/"+sku, operator, map[string]int{"on_hand": onHand, "price": price})
	if r.status != http.StatusOK {
		t.Fatalf("restock %s: %d %s", sku, r.status, r.raw)
	}
	// The order service learns the SKU from ProductUpdated a moment later:
	// until then an order for it is a 422. A probe order that gets through is
	// cancelled at once, and we wait until its stock is back.
	var probe string
	poll.Until(t, 10*time.Second, "order service knows "+sku, func() bool {
		r := placeOrder(t, "probe-"+randHex(), item(sku, 1))
		if r.status == http.StatusCreated {
			probe = r.body["order_id"].(string)
			return true
		}
		return false
	})
	if r := do(t, "POST", shop.order+"/orders/"+probe+"/cancel", nil, nil); r.status != http.StatusAccepted {
		t.Fatalf("cancel the probe order: %d %s", r.status, r.raw)
	}
	waitStatus(t, probe, "CLOSED")
	poll.Until(t, 10*time.Second, "the probe's stock released", func() bool {
		_, reserved, _ := stock(t, sku)
		return reserved == 0
	})
}

// operator is the header of an operator's request (PUT /stock/{sku}).
var operator = map[string]string{"Authorization": "Bearer " + operatorToken}

func placeOrder(t *testing.T, key string, items ...map[string]any) response {
	t.Helper()
	return do(t, "POST", shop.order+"/orders", map[string]string{"Idempotency-Key": key},
		map[string]any{"customer_id": "c-1", "items": items})
}

func item(sku string, qty int) map[string]any { return map[string]any{"sku": sku, "quantity": qty} }

func orderStatus(t *testing.T, id string) string {
	t.Helper()
	r := do(t, "GET", shop.order+"/orders/"+id, nil, nil)
	s, _ := r.body["status"].(string)
	return s
}

func waitStatus(t *testing.T, id, want string) {
	t.Helper()
	poll.Until(t, 20*time.Second, "order "+id+" "+want, func() bool { return orderStatus(t, id) == want })
}

func stock(t *testing.T, sku string) (onHand, reserved, sold int) {
	t.Helper()
	r := do(t, "GET", shop.inventory+"/stock/"+sku, nil, nil)
	f := func(k string) int { v, _ := r.body[k].(float64); return int(v) }
	return f("on_hand"), f("reserved"), f("sold")
}

// webhook sends a provider callback signed as the contract says.
func webhook(t *testing.T, orderID, providerID, status string, amount int) response {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"order_id": orderID, "provider_payment_id": providerID, "status": status, "amount": amount})
	ts := fmt.Sprint(time.Now().Unix())
	mac := hmac.New(sha256.New, []byte(webhookSecret))
	mac.Write([]byte(ts + "." + string(body)))
	return do(t, "POST", shop.payment+"/webhooks/payment",
		map[string]string{"Payment-Signature": "t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))}, body)
}

func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// sku returns a SKU no other test uses.
func sku(name string) string { return name + "-" + randHex() }

// ---- plumbing ----

func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// mainTB lets natstest run outside a test: TestMain has no testing.T.
type mainTB struct {
	testing.TB
	mu       sync.Mutex
	cleanups []func()
}

func (m *mainTB) Helper()                           {}
func (m *mainTB) TempDir() string                   { d, _ := os.MkdirTemp("", "e2e-nats-*"); return d }
func (m *mainTB) Cleanup(f func())                  { m.mu.Lock(); m.cleanups = append(m.cleanups, f); m.mu.Unlock() }
func (m *mainTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (m *mainTB) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }
