package loadgen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
	"github.com/shop-ref/shop/services/payment"
)

// env is a process environment for Run.
func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

func TestLoadgen(t *testing.T) {
	t.Parallel()
	s := shoptest.StartFor(t, services.All)
	s.Restock(t, "SKU-LOAD", 1000, 250)

	var out, errOut strings.Builder
	err := Run(context.Background(), []string{"--orders", "30", "--concurrency", "8", "--pay", "1",
		"--sku", "SKU-LOAD", "--timeout", "90s"}, env(s.Env), &out, &errOut)
	if err != nil {
		t.Fatalf("loadgen: %v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errOut.String())
	}
	report := out.String()
	t.Logf("loadgen output:\n%s", report)
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`(?m)^orders created: +30 ok, 0 failed`),
		regexp.MustCompile(`(?m)^creation: +30 in \S+ = [0-9.]+ orders/s`),
		regexp.MustCompile(`(?m)^creation latency: +p50 \S+ +p90 \S+ +p99 \S+ +max \S+`),
		regexp.MustCompile(`(?m)^payments: +30 taken, 0 refused`),
		regexp.MustCompile(`(?m)^order→COMPLETED: +30 completed +p50 \S+ +p99 \S+ +max \S+`),
		regexp.MustCompile(`(?m)^final status: +COMPLETED 30$`),
	} {
		if !want.MatchString(report) {
			t.Errorf("report does not match %s", want)
		}
	}
	// Not a terminal: no carriage returns or escape sequences.
	if strings.ContainsAny(report, "\r\033") {
		t.Error("progress drew a terminal bar into a non-terminal")
	}
}

func TestLoadgenArguments(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--order-url", "http://example.com:8081"}, "only local targets"},
		{[]string{"--payment-url", "http://10.0.0.7:8083"}, "only local targets"},
		{[]string{"--order-url", "ftp://127.0.0.1/"}, "want an http:// URL"},
		{[]string{"--orders", "0"}, "-orders 0"},
		{[]string{"--concurrency", "0"}, "-concurrency 0"},
		{[]string{"--pay", "1.5"}, "-pay 1.5"},
		{[]string{"--rate", "-1"}, "-rate -1"},
		{[]string{"extra"}, "unexpected arguments"},
		{[]string{"--no-such-flag"}, "not defined"},
	} {
		var errOut strings.Builder
		err := Run(context.Background(), tc.args, env(nil), io.Discard, &errOut)
		if !errors.Is(err, cli.ErrUsage) {
			t.Errorf("loadgen %q: err = %v, want cli.ErrUsage", tc.args, err)
			continue
		}
		if !strings.Contains(errOut.String(), tc.want) {
			t.Errorf("loadgen %q: stderr %q lacks %q", tc.args, errOut.String(), tc.want)
		}
	}
	// The environment's address counts as local when it is a bare port.
	if got := localURL(":8081"); got != "http://127.0.0.1:8081" {
		t.Errorf("localURL(:8081) = %s", got)
	}
	// Nothing listening: a clear failure, not a usage error, and no hang.
	var out strings.Builder
	err := Run(context.Background(), []string{"--order-url", "http://" + shoptest.FreeAddr(t), "--payment-url", "http://" + shoptest.FreeAddr(t)}, env(nil), &out, &out)
	if err == nil || errors.Is(err, cli.ErrUsage) || !strings.Contains(err.Error(), "no shop service answers") {
		t.Errorf("loadgen against nothing: err = %v", err)
	}
}

func TestPercentile(t *testing.T) {
	t.Parallel()
	var ds []time.Duration
	for i := 1; i <= 100; i++ {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	for p, want := range map[float64]time.Duration{.5: 50 * time.Millisecond, .9: 90 * time.Millisecond, .99: 99 * time.Millisecond, 1: 100 * time.Millisecond} {
		if got := percentile(ds, p); got != want {
			t.Errorf("p%v = %v, want %v", p*100, got, want)
		}
	}
	if percentile(nil, .5) != 0 {
		t.Error("percentile of nothing is not 0")
	}
	paid := 0
	g := &generator{cfg: config{pay: 0.9}}
	for i := range 1000 {
		if g.paid(i) {
			paid++
		}
	}
	if paid != 900 {
		t.Errorf("pay 0.9 of 1000 pays %d", paid)
	}
}

// A fake order service: the first POST of every key hangs past the request
// timeout, orders never leave PENDING. loadgen must retry with the same key
// and stop by itself at -timeout.
func TestLoadgenRetriesWithTheSameKeyAndStopsAtTimeout(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	seen := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/healthz":
		case r.Method == http.MethodPost && r.URL.Path == "/orders":
			key := r.Header.Get("Idempotency-Key")
			mu.Lock()
			seen[key]++
			first := seen[key] == 1
			mu.Unlock()
			if first {
				select {
				case <-time.After(2 * time.Second):
				case <-r.Context().Done():
				}
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"order_id":%q,"status":"PENDING"}`, "o-"+key)
		case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/orders/"):
			fmt.Fprint(w, `{"status":"PENDING"}`)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()

	var out strings.Builder
	start := time.Now()
	err := Run(context.Background(), []string{"-orders", "5", "-concurrency", "5", "-pay", "1",
		"-order-url", srv.URL, "-payment-url", srv.URL, "-request-timeout", "200ms", "-timeout", "1500ms"}, env(nil), &out, &out)
	if err == nil || !strings.Contains(err.Error(), "-timeout") {
		t.Fatalf("err = %v, want a stop by -timeout\n%s", err, out.String())
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("loadgen took %v with -timeout 1.5s", el)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 5 {
		t.Errorf("%d distinct keys, want 5: %v", len(seen), seen)
	}
	for key, n := range seen {
		if n != 2 {
			t.Errorf("key %s sent %d times, want 2 (a timeout, then the retry with the same key)", key, n)
		}
	}
	report := out.String()
	for _, want := range []string{"orders created:    5 ok, 0 failed (5 retried requests)", "stopped by -timeout", "final status:      PENDING 5", "0 completed"} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q:\n%s", want, report)
		}
	}
}

// With -follow=false loadgen only creates: no GET, no payment, and it
// returns as soon as the last order is created.
func TestLoadgenWithoutFollowingOnlyCreates(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	requests := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		requests[r.Method+" "+strings.SplitN(strings.TrimPrefix(r.URL.Path, "/"), "/", 2)[0]]++
		mu.Unlock()
		if r.Method == http.MethodPost && r.URL.Path == "/orders" {
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"order_id":%q,"status":"PENDING"}`, "o-"+r.Header.Get("Idempotency-Key"))
			return
		}
		fmt.Fprint(w, `{"status":"WAIT_PAY"}`)
	}))
	defer srv.Close()

	// Nothing listens at the payment service: creating alone never calls
	// it, so the order service may run on its own (benchsuite row 5).
	var out strings.Builder
	err := Run(context.Background(), []string{"-orders", "20", "-concurrency", "4", "-follow=false",
		"-order-url", srv.URL, "-payment-url", "http://" + shoptest.FreeAddr(t), "-timeout", "30s"}, env(nil), &out, &out)
	if err != nil {
		t.Fatalf("loadgen: %v\n%s", err, out.String())
	}
	mu.Lock()
	defer mu.Unlock()
	delete(requests, "GET healthz") // loadgen checks that the order service is up
	if want := map[string]int{"POST orders": 20}; fmt.Sprint(requests) != fmt.Sprint(want) {
		t.Errorf("requests %v, want only %v and health checks", requests, want)
	}
	// It prints what it measured, creation, and nothing it did not: no
	// pay fraction, no statuses it never polled, no completions.
	report := out.String()
	if !strings.Contains(report, "orders created:    20 ok, 0 failed") || !strings.Contains(report, "creation latency:") {
		t.Errorf("report lacks the creation figures:\n%s", report)
	}
	for _, absent := range []string{"pay ", "final status", "PENDING", "completed", "COMPLETED"} {
		if strings.Contains(report, absent) {
			t.Errorf("with -follow=false the report shows %q, which it did not measure:\n%s", absent, report)
		}
	}
}

// A request that gets no answer because its connection is reset (the
// service crashed mid-request, or is restarting) is sent again with the same
// Idempotency-Key, after a backoff, a bounded number of times.
func TestLoadgenRetriesConnectionErrorsWithTheSameKey(t *testing.T) {
	t.Parallel()
	// reset answers a request by resetting its connection (RST, not FIN).
	reset := func(t *testing.T, w http.ResponseWriter) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		_ = conn.(*net.TCPConn).SetLinger(0)
		conn.Close()
	}
	// shop answers POST /orders for a key only after fails resets; a GET of
	// an order says PENDING.
	shop := func(t *testing.T, fails int, seen map[string]int, mu *sync.Mutex) *httptest.Server {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost || r.URL.Path != "/orders" {
				return // the health checks
			}
			key := r.Header.Get("Idempotency-Key")
			mu.Lock()
			seen[key]++
			n := seen[key]
			mu.Unlock()
			if n <= fails {
				reset(t, w)
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"order_id":%q,"status":"PENDING"}`, "o-"+key)
		}))
		t.Cleanup(srv.Close)
		return srv
	}

	t.Run("retried until it gets through", func(t *testing.T) {
		t.Parallel()
		var mu sync.Mutex
		seen := map[string]int{}
		srv := shop(t, 2, seen, &mu)
		var out strings.Builder
		err := Run(context.Background(), []string{"-orders", "4", "-concurrency", "2", "-follow=false",
			"-order-url", srv.URL, "-payment-url", srv.URL, "-timeout", "30s"}, env(nil), &out, &out)
		if err != nil {
			t.Fatalf("loadgen: %v\n%s", err, out.String())
		}
		mu.Lock()
		defer mu.Unlock()
		if len(seen) != 4 {
			t.Errorf("%d distinct keys, want 4: %v", len(seen), seen)
		}
		for key, n := range seen {
			if n != 3 {
				t.Errorf("key %s sent %d times, want 3 (two resets, then the answer)", key, n)
			}
		}
		if report := out.String(); !strings.Contains(report, "orders created:    4 ok, 0 failed (") {
			t.Errorf("report:\n%s", report)
		}
	})

	t.Run("given up after a bounded number of tries", func(t *testing.T) {
		t.Parallel()
		var mu sync.Mutex
		seen := map[string]int{}
		srv := shop(t, 1<<30, seen, &mu)
		var out strings.Builder
		start := time.Now()
		err := Run(context.Background(), []string{"-orders", "1", "-concurrency", "1", "-follow=false",
			"-order-url", srv.URL, "-payment-url", srv.URL, "-timeout", "60s"}, env(nil), &out, &out)
		if err == nil || !strings.Contains(err.Error(), "1 of 1 orders failed") {
			t.Fatalf("err = %v, want the order failed\n%s", err, out.String())
		}
		if el := time.Since(start); el > 30*time.Second {
			t.Errorf("gave up after %v", el)
		}
		mu.Lock()
		defer mu.Unlock()
		// net/http itself sends a request with an Idempotency-Key again,
		// once, when a reused connection fails before any answer; so each
		// of loadgen's attempts reaches the server once or twice.
		for key, n := range seen {
			if n < maxConnRetries+1 || n > 2*(maxConnRetries+1) {
				t.Errorf("key %s sent %d times, want %d attempts (each once or twice)", key, n, maxConnRetries+1)
			}
		}
		if report := out.String(); !strings.Contains(report, fmt.Sprintf("(%d retried requests)", maxConnRetries)) {
			t.Errorf("report does not count %d retries:\n%s", maxConnRetries, report)
		}
		if report := out.String(); !strings.Contains(report, "connection reset by peer") {
			t.Errorf("report does not name the error:\n%s", report)
		}
	})
}

// A 503 (the shop shedding, or its database away) is retried with the same
// key after the Retry-After it names.
func TestLoadgenHonoursRetryAfter(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var times []time.Time
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return
		}
		mu.Lock()
		times = append(times, time.Now())
		first := len(times) == 1
		mu.Unlock()
		if first {
			w.Header().Set("Retry-After", "1")
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprint(w, `{"code":"dependency-unavailable","status":503}`)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order_id":%q,"status":"PENDING"}`, "o-"+r.Header.Get("Idempotency-Key"))
	}))
	defer srv.Close()
	var out strings.Builder
	err := Run(context.Background(), []string{"-orders", "1", "-concurrency", "1", "-follow=false",
		"-order-url", srv.URL, "-payment-url", srv.URL, "-timeout", "30s"}, env(nil), &out, &out)
	if err != nil {
		t.Fatalf("loadgen: %v\n%s", err, out.String())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(times) != 2 || times[1].Sub(times[0]) < 900*time.Millisecond {
		t.Errorf("attempts at %v, want two, a Retry-After second apart", times)
	}
}

// What an order shows is what the shop honours, also while the shop is
// busy: with loadgen paying its own orders the moment they say WAIT_PAY,
// 40 more customers do the same, half through the provider's signed
// webhook, half through simulate. Every payment is taken, every order
// completes, nothing is refunded.
//
// Not parallel: TestLoadgen runs a whole shop too, and two of them at once
// may open more connections than Postgres's default 100 (each shop's pools
// grow to about 80 under this load), which answers "too many clients".
func TestPayingTheInstantItSaysWaitPayUnderLoad(t *testing.T) {
	s := shoptest.StartFor(t, services.All)
	s.Restock(t, "SKU-BUSY", 10_000, 250)
	s.Restock(t, "SKU-NOW", 40, 990)

	var out strings.Builder
	loaded := make(chan error, 1)
	go func() {
		loaded <- Run(context.Background(), []string{"--orders", "400", "--concurrency", "16", "--pay", "1",
			"--sku", "SKU-BUSY", "--timeout", "3m"}, env(s.Env), &out, &out)
	}()
	poll.Until(t, time.Minute, "the load under way: SKU-BUSY reserved or sold", func() bool {
		res, err := http.Get(s.StockURL + "SKU-BUSY")
		if err != nil {
			return false
		}
		defer res.Body.Close()
		var st struct{ Reserved, Sold int }
		return json.NewDecoder(res.Body).Decode(&st) == nil && st.Reserved+st.Sold > 0
	})
	paid := shoptest.Customers{OrderURL: s.OrderURL, PaymentURL: s.URLs["payment"], WebhookSecret: payment.DefaultWebhookSecret}.
		PayTheInstant(t, 40, "SKU-NOW")
	shoptest.RequireAllCompleted(t, paid)
	if err := <-loaded; err != nil {
		t.Fatalf("loadgen: %v\n%s", err, out.String())
	}
	t.Logf("loadgen beside them:\n%s", out.String())
	if !regexp.MustCompile(`(?m)^payments: +400 taken, 0 refused`).MatchString(out.String()) {
		t.Errorf("loadgen's payments were not all taken:\n%s", out.String())
	}
}

// Run is `shop loadgen` as cmd/shop wires it, over the shop's own services.
func Run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	return Command{Services: services.All}.Run(ctx, args, getenv, stdout, stderr)
}
