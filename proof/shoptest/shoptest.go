// Package shoptest is what the tests of the shop's commands share: a whole
// shop running in the test process (StartFor), a database the command under
// test must create itself (NewDatabaseURL), and the small waits around them.
// Like pgtest and natstest it uses the real Postgres and a real NATS server.
package shoptest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

// NewDatabaseURL returns the URL of a database that does not exist yet, on
// the test server (pgtest.URL), and drops it when the test ends. The
// command under test must create it: that is part of what such tests check.
func NewDatabaseURL(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(pgtest.URL())
	if err != nil || u.Scheme == "" {
		t.Fatalf("test database URL must be a postgres:// URL: %v", err)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "shop_cmd_" + hex.EncodeToString(b[:])
	admin := *u
	admin.Path = "/postgres"
	u.Path = "/" + name
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, admin.String())
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		// A pool of a stopped service may still hold a connection, its
		// relays a replication slot (cdc mode): DropDatabase drops both.
		if err := pgtest.DropDatabase(ctx, conn, name); err != nil {
			t.Error(err)
		}
	})
	return u.String()
}

// FreeAddr returns a loopback address with a port nobody listens on.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Shop is a whole shop running in the test process, as proof/e2e
// starts it.
type Shop struct {
	Env      map[string]string // the environment it was started with, for the commands that drive it
	OrderURL string            // http://<order service>
	StockURL string            // http://<inventory service>/stock/
	URLs     map[string]string // every service's base URL, by name
}

// StartFor runs every service of reg against a throwaway database and a
// test NATS server that requires each service's own user (the audit user's
// and the stream keeper's passwords are in Env too: the shop keeps its
// streams), on free loopback ports, with the fake payment
// provider on, until the test ends; it returns once every service is ready.
func StartFor(t testing.TB, reg registry.Registry) *Shop {
	t.Helper()
	return StartWith(t, reg, nil)
}

// StartWith is StartFor with env added to the shop's environment (and
// winning over it): OTEL_EXPORTER_OTLP_ENDPOINT, say. The OTLP exporter
// reads its other OTEL_* variables from the process's environment
// (t.Setenv).
func StartWith(t testing.TB, reg registry.Registry, env map[string]string) *Shop {
	t.Helper()
	ns, passwords := natstest.NewSecured(t, reg.Access())
	// A DATABASE_URL in env (a private cluster's, proof/pgcluster) is
	// used as it is: no throwaway database on the test server then.
	dbURL := env["DATABASE_URL"]
	if dbURL == "" {
		dbURL = pgtest.NewDatabase(t, "shop_cmd_").URL
	}
	vars := map[string]string{
		"DATABASE_URL":          dbURL,
		"NATS_URL":              ns.URL(),
		"FULFILLMENT_DELAY":     "100ms",
		"PAYMENT_FAKE_PROVIDER": "true", // loadgen pays through /simulate
	}
	// Port 0 everywhere, not the machine's :8080 and the like: each
	// listener takes a free port as it binds, and the test reads it from
	// the service's "http listening" line. An address chosen beforehand
	// (FreeAddr) can be taken meanwhile by any outgoing connection's
	// ephemeral port: "bind: address already in use", once in CI.
	vars["DASHBOARD_ADDR"] = "127.0.0.1:0"
	vars[broker.PasswordVar(broker.AuditUser)] = passwords[broker.AuditUser]
	vars[broker.PasswordVar(broker.StreamsUser)] = passwords[broker.StreamsUser]
	for _, name := range reg.Names() {
		vars[strings.ToUpper(name)+"_ADDR"] = "127.0.0.1:0"
		vars[broker.PasswordVar(name)] = passwords[name]
	}
	// RELAY_MODE=cdc go test ... runs every whole shop of the tests with
	// its relays in that mode (README, "Relay mode"); unset, the shop's
	// default. env wins, for a test that runs each mode itself.
	if mode := os.Getenv("RELAY_MODE"); mode != "" {
		vars["RELAY_MODE"] = mode
	}
	maps.Copy(vars, env)
	cfg, err := config.LoadFor(reg, func(k string) string { return vars[k] })
	if err != nil {
		t.Fatal(err)
	}
	// SHOPTEST_LOG=file keeps the shop's log, to see why a test failed.
	listening := &listenLines{}
	var logTo io.Writer = listening
	if path := os.Getenv("SHOPTEST_LOG"); path != "" {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		logTo = io.MultiWriter(listening, f)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- app.Run(ctx, cfg, reg.Names(), slog.New(slog.NewTextHandler(logTo, nil)))
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("shop: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("the shop did not stop within 30s")
		}
	})
	stopped := func() {
		select {
		case err := <-done:
			t.Fatalf("the shop stopped before it was ready: %v", err)
		default:
		}
	}
	var bound map[string]string
	poll.Until(t, 30*time.Second, "every service listening", func() bool {
		stopped()
		bound = listening.addrs()
		for _, name := range reg.Names() {
			if bound[name] == "" {
				return false
			}
		}
		return true
	})
	urls := map[string]string{}
	for _, name := range reg.Names() {
		addr := bound[name]
		vars[strings.ToUpper(name)+"_ADDR"] = addr
		urls[name] = "http://" + addr
		poll.Until(t, 30*time.Second, name+" ready", func() bool {
			stopped()
			res, err := http.Get("http://" + addr + "/readyz")
			if err != nil {
				return false
			}
			res.Body.Close()
			return res.StatusCode == http.StatusOK
		})
	}
	return &Shop{Env: vars, OrderURL: urls["order"], StockURL: urls["inventory"] + "/stock/", URLs: urls}
}

// Restock stocks sku and waits until the order service accepts orders for
// it (it learns SKUs from inventory's events): a probe order gets through,
// and is cancelled at once.
func (s *Shop) Restock(t testing.TB, sku string, onHand, price int) {
	t.Helper()
	body, _ := json.Marshal(map[string]int{"on_hand": onHand, "price": price})
	req, _ := http.NewRequest(http.MethodPut, s.StockURL+sku, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("restock %s: %s", sku, res.Status)
	}
	var probe string
	poll.Until(t, 15*time.Second, "the order service knows "+sku, func() bool {
		body := fmt.Sprintf(`{"customer_id":"probe","items":[{"sku":%q,"quantity":1}]}`, sku)
		req, _ := http.NewRequest(http.MethodPost, s.OrderURL+"/orders", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "probe-"+sku+"-"+time.Now().Format(time.RFC3339Nano))
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		defer res.Body.Close()
		var o struct {
			OrderID string `json:"order_id"`
		}
		_ = json.NewDecoder(res.Body).Decode(&o)
		probe = o.OrderID
		return res.StatusCode == http.StatusCreated
	})
	poll.Until(t, 15*time.Second, "the probe order cancelled", func() bool {
		res, err := http.Post(s.OrderURL+"/orders/"+probe+"/cancel", "application/json", nil)
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusAccepted
	})
}

// Complete orders quantity of sku for customer, pays for it through the fake
// provider the moment the order says WAIT_PAY, and waits until the saga has
// completed it; it returns the order's id and total.
func (s *Shop) Complete(t testing.TB, customer, sku string, quantity int) (id string, total int64) {
	t.Helper()
	body := fmt.Sprintf(`{"customer_id":%q,"items":[{"sku":%q,"quantity":%d}]}`, customer, sku, quantity)
	req, _ := http.NewRequest(http.MethodPost, s.OrderURL+"/orders", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "complete-"+customer+"-"+time.Now().Format(time.RFC3339Nano))
	var o struct {
		OrderID string `json:"order_id"`
		Total   int64  `json:"total"`
		Status  string `json:"status"`
	}
	if status := s.doJSON(t, req, &o); status != http.StatusCreated {
		t.Fatalf("POST /orders: %d", status)
	}
	poll.Until(t, 20*time.Second, "order "+o.OrderID+" WAIT_PAY", func() bool {
		req, _ := http.NewRequest(http.MethodGet, s.OrderURL+"/orders/"+o.OrderID, nil)
		return s.doJSON(t, req, &o) == http.StatusOK && o.Status == "WAIT_PAY"
	})
	req, _ = http.NewRequest(http.MethodPost, s.URLs["payment"]+"/payments/"+o.OrderID+"/simulate", strings.NewReader(`{"outcome":"succeeded"}`))
	req.Header.Set("Content-Type", "application/json")
	if status := s.doJSON(t, req, nil); status != http.StatusOK {
		t.Fatalf("simulate payment of %s: %d", o.OrderID, status)
	}
	poll.Until(t, 30*time.Second, "order "+o.OrderID+" COMPLETED", func() bool {
		req, _ := http.NewRequest(http.MethodGet, s.OrderURL+"/orders/"+o.OrderID, nil)
		return s.doJSON(t, req, &o) == http.StatusOK && o.Status == "COMPLETED"
	})
	return o.OrderID, o.Total
}

// Call sends a request as a client would (a JSON body when body is not
// empty, the given headers) and returns the status and the answer's body,
// trimmed; it fails t when the request cannot be sent.
func Call(t testing.TB, method, url string, header map[string]string, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatalf("%s %s: read the answer: %v", method, url, err)
	}
	return res.StatusCode, bytes.TrimSpace(b)
}

// doJSON sends req and decodes a JSON answer into v (when not nil); it
// returns the status, 0 when the request failed.
func (s *Shop) doJSON(t testing.TB, req *http.Request, v any) int {
	t.Helper()
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	defer res.Body.Close()
	if v != nil {
		_ = json.NewDecoder(res.Body).Decode(v)
	}
	return res.StatusCode
}

// listenLines is a log destination that keeps the services' "http
// listening" records (slog's text handler writes a record at a time).
type listenLines struct{ logbuf.Buffer }

func (l *listenLines) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte(`msg="http listening"`)) {
		return l.Buffer.Write(p)
	}
	return len(p), nil
}

var listenRecord = regexp.MustCompile(`msg="http listening" service=(\S+) addr=(\S+)`)

// addrs is the address each service said it listens on, by name.
func (l *listenLines) addrs() map[string]string {
	out := map[string]string{}
	for _, m := range listenRecord.FindAllStringSubmatch(l.String(), -1) {
		out[m[1]] = m[2]
	}
	return out
}
