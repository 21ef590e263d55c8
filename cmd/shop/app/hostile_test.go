package app

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"

	"github.com/shop-ref/shop/proof/apitest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/services"
	"github.com/shop-ref/shop/services/payment"
)

// validRequest is a request a route accepts as far as its input goes: the
// hostile cases change one thing of it, so that only that one thing can be
// what refuses them.
type validRequest struct {
	header map[string]string
	body   string
	// reads are the headers the route reads and must refuse when they
	// cannot be what they name.
	reads []string
}

// TestHostileInputIsRefused sends what no id or header of the shop can be
// (a NUL, invalid UTF-8, 10 KB, a traversal) to every route of every
// service, as the routers themselves list them, so a new route is tried as
// soon as it exists: each path parameter and each header a route reads. The
// answer must be a 4xx problem+json that api/openapi.yaml describes, never a
// 500: a payment id with a NUL used to reach Postgres ("invalid byte
// sequence for encoding UTF8: 0x00") and be one. Headers a route ignores
// (trace context) must not make it fail either.
//
// Requests go straight to the handler every server runs (newHTTPServer's),
// not over a socket: net/http itself refuses a NUL in a header with its own
// plain-text 400 before any handler, and the handler must hold without it.
func TestHostileInputIsRefused(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	nc, js := ns.Connect(t)
	const secret, token = "hostile-secret", "hostile-token"
	cfg, err := LoadConfig(func(k string) string {
		return map[string]string{"PAYMENT_FAKE_PROVIDER": "true", "PAYMENT_WEBHOOK_SECRET": secret, "OPERATOR_TOKEN": token}[k]
	})
	if err != nil {
		t.Fatal(err)
	}
	checker, err := apitest.New()
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)

	// A failure for an order payment does not know: a 404 that writes
	// nothing, once signature, content type and body have passed.
	webhook := fmt.Sprintf(`{"order_id":%q,"provider_payment_id":"p-hostile","status":"failed","amount":100}`, uuid.NewString())
	jsonType := "application/json"
	valid := map[string]validRequest{
		"GET /healthz": {},
		"GET /readyz":  {},
		"GET /metrics": {},
		"POST /orders": {
			header: map[string]string{"Idempotency-Key": "k-hostile", "Content-Type": jsonType},
			body:   `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`,
			reads:  []string{"Idempotency-Key", "Content-Type"},
		},
		"GET /orders/{id}":         {},
		"POST /orders/{id}/cancel": {},
		"GET /stock/{sku}":         {},
		"PUT /stock/{sku}": {
			header: map[string]string{"Authorization": "Bearer " + token, "Content-Type": jsonType},
			body:   `{"on_hand":1,"price":1}`,
			reads:  []string{"Authorization", "Content-Type"},
		},
		"POST /webhooks/payment": {
			header: map[string]string{"Content-Type": jsonType, payment.SignatureHeader: payment.Sign(secret, time.Now(), []byte(webhook))},
			body:   webhook,
			reads:  []string{payment.SignatureHeader, "Content-Type"},
		},
		"POST /payments/{order_id}/simulate": {
			header: map[string]string{"Content-Type": jsonType},
			body:   `{"outcome":"succeeded"}`,
			reads:  []string{"Content-Type"},
		},
		"GET /payments/{order_id}":  {},
		"GET /shipments/{order_id}": {},
		// The guide's example (examples/loyalty, in a build with the
		// fifthservice tag).
		"GET /points/{customer}": {},
	}
	// A valid value of each path parameter.
	validParam := map[string]func() string{
		"id":       uuid.NewString,
		"order_id": uuid.NewString,
		"sku":      func() string { return "SKU-1" },
		"customer": func() string { return "c-1" },
	}
	// Path values as they are written in the URL.
	hostilePaths := map[string]func(valid string) string{
		"NUL":                     func(string) string { return "%00" },
		"NUL after a valid value": func(v string) string { return v + "%00" },
		"invalid UTF-8":           func(string) string { return "%FF%FE" },
		"10 KB":                   func(string) string { return strings.Repeat("a", 10<<10) },
		"escaped traversal":       func(string) string { return "..%2F..%2F..%2Fetc%2Fpasswd" },
		"dot-dot":                 func(string) string { return ".." },
		"escaped dot-dot":         func(string) string { return "%2E%2E" },
		"quote and comment":       func(v string) string { return v + "%27%3B--" },
	}
	hostileHeaders := map[string]string{
		"NUL":           "a\x00b",
		"invalid UTF-8": "\xff\xfe",
		"10 KB":         strings.Repeat("a", 10<<10),
	}

	for _, e := range services.All {
		name := e.Name
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			router := assembled(t, e, cfg, nc, js, log)
			srv, err := newHTTPServer(router, defaultHTTPLimits(), log)
			if err != nil {
				t.Fatal(err)
			}
			var routes []string // "GET /orders/{id}"
			err = chi.Walk(router.(chi.Routes), func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
				routes = append(routes, method+" "+chiPattern(route))
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(routes)
			for _, route := range routes {
				req, ok := valid[route]
				if !ok {
					t.Errorf("%s is served by the %s router but this test has no valid request of it: add one to valid, with the headers it reads", route, name)
					continue
				}
				method, pattern, _ := strings.Cut(route, " ")
				params := chiParam.FindAllStringSubmatch(pattern, -1)
				fill := func(param, value string) string {
					return chiParam.ReplaceAllStringFunc(pattern, func(m string) string {
						p := chiParam.FindStringSubmatch(m)[1]
						if p == param {
							return value
						}
						return validParam[p]()
					})
				}

				for _, p := range params {
					if validParam[p[1]] == nil {
						t.Errorf("%s: no valid value of path parameter {%s} in validParam", route, p[1])
						continue
					}
					for _, kind := range slices.Sorted(maps.Keys(hostilePaths)) {
						target := fill(p[1], hostilePaths[kind](validParam[p[1]]()))
						methods := []string{method}
						if method == http.MethodGet {
							methods = append(methods, http.MethodHead)
						}
						for _, m := range methods {
							where := fmt.Sprintf("%s %s with {%s} %s", m, pattern, p[1], kind)
							wantRefused(t, checker, srv.Handler, where, m, target, req.header, req.body)
						}
					}
				}

				target := fill("", "")
				for _, header := range req.reads {
					for _, kind := range slices.Sorted(maps.Keys(hostileHeaders)) {
						h := maps.Clone(req.header)
						h[header] = hostileHeaders[kind]
						where := fmt.Sprintf("%s %s with %s %s", method, pattern, header, kind)
						wantRefused(t, checker, srv.Handler, where, method, target, h, req.body)
					}
				}
				// Trace context is read by every route but the probes'
				// and ignored when it is not W3C's: the request is
				// answered as without it.
				for _, kind := range slices.Sorted(maps.Keys(hostileHeaders)) {
					h := maps.Clone(req.header)
					if h == nil {
						h = map[string]string{}
					}
					h["Traceparent"], h["Tracestate"] = hostileHeaders[kind], hostileHeaders[kind]
					rec := serve(srv.Handler, method, target, h, req.body)
					if rec.Code >= 500 {
						t.Errorf("%s %s with trace context %s: %d %s, want the answer without it", method, pattern, kind, rec.Code, rec.Body)
					}
				}
			}
		})
	}
}

// serve sends one request to h. Headers are set in the map itself, as they
// would arrive, without http.Header's canonical checks.
func serve(h http.Handler, method, target string, header map[string]string, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, target, strings.NewReader(body))
	if body == "" {
		req = httptest.NewRequest(method, target, nil)
	}
	for k, v := range header {
		req.Header[http.CanonicalHeaderKey(k)] = []string{v}
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// wantRefused sends one request and requires a 4xx problem that
// api/openapi.yaml documents for the operation (a HEAD's without its body),
// and the challenge on a 401.
func wantRefused(t *testing.T, checker *apitest.Checker, h http.Handler, where, method, target string, header map[string]string, body string) {
	t.Helper()
	rec := serve(h, method, target, header, body)
	if rec.Code < 400 || rec.Code > 499 || rec.Header().Get("Content-Type") != "application/problem+json" {
		t.Errorf("%s: %d %q %.200s, want a 4xx problem+json", where, rec.Code, rec.Header().Get("Content-Type"), rec.Body)
		return
	}
	if rec.Code == http.StatusUnauthorized && rec.Header().Get("WWW-Authenticate") == "" {
		t.Errorf("%s: 401 without WWW-Authenticate", where)
	}
	answer := rec.Body.Bytes()
	if method == http.MethodHead {
		answer = nil // net/http drops a HEAD's body; the recorder keeps it
	} else {
		var p struct{ Status int }
		if err := json.Unmarshal(answer, &p); err != nil || p.Status != rec.Code {
			t.Errorf("%s: problem %.200s (%v), want its status %d in it", where, answer, err, rec.Code)
		}
	}
	req := httptest.NewRequest(method, target, nil)
	if err := checker.Check(req, rec.Code, rec.Header(), answer); err != nil {
		t.Errorf("%s: %v", where, err)
	}
}
