package dashboard_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/ops/dashboard"
)

// The tests of this file act as the attacker of issue 39: an anonymous
// client of a dashboard that is not a demo, a page on another site that
// posts to the dashboard in the operator's browser, and a DNS-rebinding page
// whose own name points at the dashboard.

// backends is an order and a payment service that count what reaches them
// and accept it, so that a test sees whether the dashboard acted.
type backends struct {
	order, payment *httptest.Server
	orders, pays   atomic.Int32
}

func newBackends(t *testing.T) *backends {
	t.Helper()
	s := &backends{}
	s.order = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.orders.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"order_id":"`+uuid.NewString()+`","status":"PENDING"}`)
	}))
	s.payment = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.pays.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"status":"succeeded"}`)
	}))
	t.Cleanup(s.order.Close)
	t.Cleanup(s.payment.Close)
	return s
}

// serve serves a dashboard of cfg, its pools and service URLs filled in
// when cfg has none.
func serve(t *testing.T, cfg dashboard.Config, svc *backends) *httptest.Server {
	t.Helper()
	if cfg.Pools == nil {
		cfg.Pools = map[string]dashboard.DB{"order": failingDB{}}
	}
	cfg.OrderURL, cfg.PaymentURL = svc.order.URL, svc.payment.URL
	d, err := dashboard.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	return srv
}

// send makes a request with the given headers ("Host" sets the Host) and
// returns the response with its body read.
func send(t *testing.T, method, url string, header map[string]string, body string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		if k == "Host" {
			req.Host = v
		} else {
			req.Header.Set(k, v)
		}
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res, string(b)
}

// TestReadOnlyOutsideTheDemo: an anonymous client posts to the order and
// pay endpoints of a dashboard that is not a demo, with the payment
// service's fake provider on: neither exists, nothing reaches the services,
// and the state tells the page to offer neither button.
func TestReadOnlyOutsideTheDemo(t *testing.T) {
	t.Parallel()
	svc := newBackends(t)
	pools, _ := schemas(t)
	srv := serve(t, dashboard.Config{Pools: pools, CanPay: true}, svc)

	for _, path := range []string{"/api/demo/order", "/api/demo/pay/" + uuid.NewString()} {
		for _, ct := range []string{"application/json", "text/plain"} {
			res, body := send(t, "POST", srv.URL+path, map[string]string{"Content-Type": ct}, `{}`)
			if res.StatusCode != http.StatusNotFound && res.StatusCode != http.StatusMethodNotAllowed {
				t.Errorf("POST %s (%s): %s %s, want 404 or 405", path, ct, res.Status, body)
			}
		}
	}
	if n, m := svc.orders.Load(), svc.pays.Load(); n != 0 || m != 0 {
		t.Errorf("the dashboard called the order service %d times and payment %d times, want none", n, m)
	}
	st := getState(t, srv.URL)
	if st.CanOrder || st.CanPay {
		t.Errorf("state: can_order %v, can_pay %v; want neither outside the demo", st.CanOrder, st.CanPay)
	}

	demo := serve(t, dashboard.Config{Pools: pools, Demo: true, CanPay: true}, svc)
	if st := getState(t, demo.URL); !st.CanOrder || !st.CanPay {
		t.Errorf("demo state: can_order %v, can_pay %v; want both", st.CanOrder, st.CanPay)
	}
}

// TestCrossSiteRequestsRefused: a page on another origin makes the
// operator's browser post to a demo dashboard. A text/plain POST needs no
// CORS preflight, so the browser sends it; the dashboard must not act on it.
func TestCrossSiteRequestsRefused(t *testing.T) {
	t.Parallel()
	svc := newBackends(t)
	srv := serve(t, dashboard.Config{Demo: true, CanPay: true}, svc)
	pay := "/api/demo/pay/" + uuid.NewString()

	for _, tc := range []struct {
		name   string
		path   string
		header map[string]string
	}{
		{"a fetch from another site", "/api/demo/order", map[string]string{"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"}},
		{"a fetch from another site, to pay", pay, map[string]string{"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"}},
		{"a page on another port of the same machine", "/api/demo/order", map[string]string{"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:3000"}},
		{"an older browser: Origin only", "/api/demo/order", map[string]string{"Origin": "http://evil.example"}},
		{"an older browser: a sandboxed page", pay, map[string]string{"Origin": "null"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.header["Content-Type"] = "text/plain"
			res, body := send(t, "POST", srv.URL+tc.path, tc.header, "x")
			if res.StatusCode != http.StatusForbidden || !strings.Contains(body, "cross-origin") {
				t.Errorf("got %s %s, want 403 naming the cross-origin request", res.Status, body)
			}
		})
	}
	if n, m := svc.orders.Load(), svc.pays.Load(); n != 0 || m != 0 {
		t.Fatalf("cross-site requests reached the order service %d times and payment %d times, want none", n, m)
	}

	// The page's own requests, and a client that is no browser, still act.
	for _, header := range []map[string]string{
		{"Sec-Fetch-Site": "same-origin", "Origin": srv.URL},
		{"Origin": srv.URL},
		{},
	} {
		if res, body := send(t, "POST", srv.URL+"/api/demo/order", header, ""); res.StatusCode != http.StatusCreated {
			t.Errorf("POST with %v: %s %s, want 201", header, res.Status, body)
		}
	}
	if n := svc.orders.Load(); n != 3 {
		t.Errorf("the order service got %d orders, want the 3 same-origin ones", n)
	}
}

// TestForeignHostRefused: a DNS-rebinding page points a name of its own at
// the dashboard's address, so that the browser lets it read the answers and
// post as its own origin. Its requests carry that name as Host: every one is
// refused before it reads or acts. Loopback names and the names the
// dashboard is given are served.
func TestForeignHostRefused(t *testing.T) {
	t.Parallel()
	svc := newBackends(t)
	srv := serve(t, dashboard.Config{Demo: true, CanPay: true, Hosts: []string{"shop.example", "Ops.Example."}}, svc)
	port := srv.URL[strings.LastIndex(srv.URL, ":")+1:]

	for _, host := range []string{"rebind.evil.example:" + port, "rebind.evil.example", "127.0.0.1.nip.io:" + port,
		"shop.example.evil.example:" + port, "localhost.evil.example", "0.0.0.0:" + port} {
		for _, req := range []struct{ method, path string }{
			{"GET", "/"}, {"GET", "/api/state"}, {"GET", "/api/events"}, {"GET", "/api/series"},
			{"GET", "/api/orders/" + uuid.NewString() + "/journey"}, {"POST", "/api/demo/order"},
		} {
			res, body := send(t, req.method, srv.URL+req.path, map[string]string{"Host": host}, "")
			if res.StatusCode != http.StatusMisdirectedRequest || !strings.Contains(body, "DASHBOARD_HOSTS") {
				t.Errorf("%s %s with Host %q: %s %s, want 421 naming DASHBOARD_HOSTS", req.method, req.path, host, res.Status, body)
			}
		}
	}
	if n := svc.orders.Load(); n != 0 {
		t.Fatalf("requests with a foreign Host placed %d orders, want none", n)
	}

	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "LocalHost.:" + port, "[::1]:" + port,
		"shop.example:" + port, "ops.example", "localhost"} {
		if res, body := send(t, "GET", srv.URL+"/static/style.css", map[string]string{"Host": host}, ""); res.StatusCode != http.StatusOK {
			t.Errorf("GET with Host %q: %s %.200s, want 200", host, res.Status, body)
		}
	}
}

// TestSecurityHeaders: every answer, a refusal's too, forbids framing and
// carries a content-security policy that admits the page's own script and
// nothing else; none grants another origin a read (no CORS).
func TestSecurityHeaders(t *testing.T) {
	t.Parallel()
	svc := newBackends(t)
	srv := serve(t, dashboard.Config{Demo: true}, svc)
	evil := map[string]string{"Origin": "http://evil.example"}
	for _, req := range []struct {
		method, path string
		header       map[string]string
		want         int
	}{
		{"GET", "/", nil, http.StatusOK},
		{"GET", "/static/app.js", nil, http.StatusOK},
		{"GET", "/api/state", evil, http.StatusServiceUnavailable}, // failingDB: the databases do not answer
		{"GET", "/api/series", evil, http.StatusOK},
		{"GET", "/api/orders/not-a-uuid/journey", evil, http.StatusBadRequest},
		{"GET", "/no/such/page", nil, http.StatusNotFound},
		{"POST", "/api/demo/order", map[string]string{"Sec-Fetch-Site": "cross-site"}, http.StatusForbidden},
		{"GET", "/", map[string]string{"Host": "evil.example"}, http.StatusMisdirectedRequest},
		{"OPTIONS", "/api/state", map[string]string{"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"}, http.StatusMethodNotAllowed},
	} {
		res, _ := send(t, req.method, srv.URL+req.path, req.header, "")
		h := res.Header
		what := req.method + " " + req.path
		if res.StatusCode != req.want {
			t.Errorf("%s: %s, want %d", what, res.Status, req.want)
		}
		if h.Get("X-Frame-Options") != "DENY" || h.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("%s: X-Frame-Options %q, X-Content-Type-Options %q", what, h.Get("X-Frame-Options"), h.Get("X-Content-Type-Options"))
		}
		csp := h.Get("Content-Security-Policy")
		for _, d := range []string{"default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"} {
			if !strings.Contains(csp, d) {
				t.Errorf("%s: Content-Security-Policy %q lacks %q", what, csp, d)
			}
		}
		if strings.Contains(csp, "unsafe") {
			t.Errorf("%s: Content-Security-Policy %q allows unsafe sources", what, csp)
		}
		for k := range h {
			if strings.HasPrefix(k, "Access-Control-") {
				t.Errorf("%s: %s: %s grants another origin access", what, k, h.Get(k))
			}
		}
	}
}
