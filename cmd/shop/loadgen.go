package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shop-ref/shop/internal/app"
)

// loadgenConfig is what the flags of shop loadgen set.
type loadgenConfig struct {
	orders         int
	concurrency    int
	rate           float64
	pay            float64
	skus           []string
	quantity       int
	orderURL       string
	paymentURL     string
	timeout        time.Duration
	requestTimeout time.Duration
	waitComplete   bool
	follow         bool
}

// skuList is a repeatable, comma-separated flag.
type skuList []string

func (l *skuList) String() string { return strings.Join(*l, ",") }
func (l *skuList) Set(s string) error {
	for part := range strings.SplitSeq(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			*l = append(*l, part)
		}
	}
	return nil
}

// localURL turns a listen address (":8081", "0.0.0.0:8081") into a URL on
// the loopback interface.
func localURL(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "http://" + addr
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}

// checkLocal refuses every target but this machine: load is only ever
// generated against a local shop.
func checkLocal(flagName, raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("-%s %q: want an http:// URL", flagName, raw)
	}
	switch h := u.Hostname(); h {
	case "127.0.0.1", "localhost", "::1":
	default:
		return "", fmt.Errorf("-%s %q: refusing to generate load against %q: only local targets (127.0.0.1, localhost) are allowed on this machine", flagName, raw, h)
	}
	return strings.TrimRight(u.String(), "/"), nil
}

func runLoadgen(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cfg, err := app.LoadConfig(getenv)
	if err != nil {
		return err
	}
	var lc loadgenConfig
	var skus skuList
	fs := flag.NewFlagSet("shop loadgen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, `Usage: shop loadgen [flags]

Drives orders through the public HTTP API of a local shop: each order is a
POST /orders with its own Idempotency-Key (a timed-out request is retried with
the same key); a fraction is paid through POST /payments/{id}/simulate once the
order waits for payment (the payment service serves it only with its fake
provider on: shop all -demo, or PAYMENT_FAKE_PROVIDER=true). At the end it prints throughput and latency
percentiles of order creation and of order-to-COMPLETED. Only local targets
are allowed.

Flags:
`)
		fs.PrintDefaults()
	}
	fs.IntVar(&lc.orders, "orders", 1000, "how many orders to place")
	fs.IntVar(&lc.concurrency, "concurrency", 32, "orders in creation at once")
	fs.Float64Var(&lc.rate, "rate", 0, "orders started per second (0: as fast as -concurrency allows)")
	fs.Float64Var(&lc.pay, "pay", 0.9, "fraction of the orders to pay (0…1); the rest are left waiting for payment")
	fs.Var(&skus, "sku", "`SKU` to order, one per order in turn (repeatable or comma-separated; default SKU-1)")
	fs.IntVar(&lc.quantity, "quantity", 1, "quantity of each order's one line")
	fs.StringVar(&lc.orderURL, "order-url", localURL(cfg.Services["order"].Addr), "base `URL` of the order service (default from ORDER_ADDR)")
	fs.StringVar(&lc.paymentURL, "payment-url", localURL(cfg.Services["payment"].Addr), "base `URL` of the payment service (default from PAYMENT_ADDR)")
	fs.DurationVar(&lc.timeout, "timeout", 2*time.Minute, "stop after this long, finished or not")
	fs.DurationVar(&lc.requestTimeout, "request-timeout", 10*time.Second, "timeout of one HTTP request (a timed-out order creation is retried with the same key)")
	fs.BoolVar(&lc.waitComplete, "wait-complete", true, "follow each paid order to COMPLETED (or CLOSED/REJECTED) to measure order-to-COMPLETED")
	fs.BoolVar(&lc.follow, "follow", true, "poll each created order (GET /orders/{id}) to pay it and see it settle; false: only create orders, pay none, and measure POST /orders alone")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("loadgen: %v: %w", err, errUsage)
	}
	bad := func(format string, args ...any) error {
		msg := fmt.Sprintf(format, args...)
		fmt.Fprintf(stderr, "shop loadgen: %s\n", msg)
		return fmt.Errorf("loadgen: %s: %w", msg, errUsage)
	}
	switch {
	case fs.NArg() > 0:
		return bad("unexpected arguments %q", fs.Args())
	case lc.orders <= 0:
		return bad("-orders %d: want at least 1", lc.orders)
	case lc.concurrency <= 0:
		return bad("-concurrency %d: want at least 1", lc.concurrency)
	case lc.rate < 0 || math.IsNaN(lc.rate) || math.IsInf(lc.rate, 0):
		return bad("-rate %v: want 0 (unlimited) or a positive number of orders per second", lc.rate)
	case !(lc.pay >= 0 && lc.pay <= 1):
		return bad("-pay %v: want a fraction from 0 to 1", lc.pay)
	case lc.quantity < 1 || lc.quantity > 1000:
		return bad("-quantity %d: want 1…1000", lc.quantity)
	case lc.timeout <= 0 || lc.requestTimeout <= 0:
		return bad("-timeout and -request-timeout must be positive")
	}
	lc.skus = skus
	if len(lc.skus) == 0 {
		lc.skus = []string{"SKU-1"}
	}
	if lc.orderURL, err = checkLocal("order-url", lc.orderURL); err != nil {
		return bad("%v", err)
	}
	if lc.paymentURL, err = checkLocal("payment-url", lc.paymentURL); err != nil {
		return bad("%v", err)
	}

	g := newLoadgen(lc, stdout)
	if err := g.preflight(ctx); err != nil {
		return err
	}
	return g.run(ctx)
}

// ---- the generator ----

// orderRun is what loadgen learns about one order.
type orderRun struct {
	id        string
	created   bool
	failed    error
	createdAt time.Time     // when the first POST of it was sent
	createLat time.Duration // first send to the 2xx
	toDone    time.Duration // first send to COMPLETED; 0 if never seen
	status    string        // the last status seen
}

type loadgen struct {
	cfg    loadgenConfig
	out    io.Writer
	client *http.Client
	runID  string

	created, failed, retried, completed, settled atomic.Int64
	firstErr                                     atomic.Value // string
}

func newLoadgen(cfg loadgenConfig, out io.Writer) *loadgen {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 2*cfg.concurrency + 16
	var b [4]byte
	_, _ = rand.Read(b[:])
	return &loadgen{
		cfg: cfg, out: out, runID: hex.EncodeToString(b[:]),
		client: &http.Client{Transport: tr, Timeout: cfg.requestTimeout},
	}
}

// preflight fails fast when nothing listens at the order service.
func (g *loadgen) preflight(ctx context.Context) error {
	for _, base := range []string{g.cfg.orderURL, g.cfg.paymentURL} {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/healthz", nil)
		if err != nil {
			return err
		}
		res, err := g.client.Do(req)
		if err != nil {
			return fmt.Errorf("loadgen: no shop service answers at %s: %w", base, err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			return fmt.Errorf("loadgen: %s/healthz answered %s", base, res.Status)
		}
	}
	return nil
}

// paid reports whether order i (from 0) is one of the paid ones; the paid
// orders are spread evenly and are exactly round(pay*N) of N.
func (g *loadgen) paid(i int) bool {
	return math.Floor(float64(i+1)*g.cfg.pay+1e-9) > math.Floor(float64(i)*g.cfg.pay+1e-9)
}

func (g *loadgen) noteErr(err error) {
	g.firstErr.CompareAndSwap(nil, err.Error())
}

func (g *loadgen) run(parent context.Context) error {
	ctx, cancel := context.WithTimeout(parent, g.cfg.timeout)
	defer cancel()
	n := g.cfg.orders
	runs := make([]orderRun, n)
	start := time.Now()

	// Feed the order numbers, at the rate asked for.
	jobs := make(chan int)
	go func() {
		defer close(jobs)
		var tick *time.Ticker
		if g.cfg.rate > 0 {
			tick = time.NewTicker(time.Duration(float64(time.Second) / g.cfg.rate))
			defer tick.Stop()
		}
		for i := range n {
			if tick != nil && i > 0 {
				select {
				case <-tick.C:
				case <-ctx.Done():
					return
				}
			}
			select {
			case jobs <- i:
			case <-ctx.Done():
				return
			}
		}
	}()

	// Followers poll orders in the background; their GETs share a limit so
	// that following does not drown the service.
	follow := make(chan struct{}, g.cfg.concurrency)
	var creators, followers sync.WaitGroup
	for range g.cfg.concurrency {
		creators.Go(func() {
			for i := range jobs {
				r := &runs[i]
				g.create(ctx, i, r)
				if !r.created {
					continue
				}
				if g.cfg.follow {
					followers.Go(func() { g.follow(ctx, i, r, follow) })
				}
			}
		})
	}

	stopProgress := g.progress(start, n)
	creators.Wait()
	creationEnd := time.Now()
	followers.Wait()
	stopProgress()

	timedOut := ctx.Err() != nil && parent.Err() == nil
	g.report(runs, start, creationEnd, time.Since(start), timedOut)
	switch {
	case parent.Err() != nil:
		return parent.Err()
	case timedOut:
		return fmt.Errorf("loadgen: stopped by -timeout %v before every order was done", g.cfg.timeout)
	case g.failed.Load() > 0:
		return fmt.Errorf("loadgen: %d of %d orders failed", g.failed.Load(), n)
	}
	return nil
}

// maxConnRetries bounds the retries of one order's request that got no
// answer at all (timed out, connection refused or reset, the response cut
// off): the service may be restarting, but one that stays away fails the
// order rather than keeping it spinning until -timeout.
const maxConnRetries = 8

// maxRetryWait caps the wait between two attempts, Retry-After included.
const maxRetryWait = 5 * time.Second

// create places order i, retrying what a careful client retries — a
// request that got no answer, a twin in flight (409), a shop refusing for
// now (429, 5xx) — with the same Idempotency-Key, so that a first attempt
// that did commit is answered with its order instead of making a second.
// It waits as the answer's Retry-After says, else with capped backoff.
func (g *loadgen) create(ctx context.Context, i int, r *orderRun) {
	key := fmt.Sprintf("loadgen-%s-%d", g.runID, i)
	body, _ := json.Marshal(map[string]any{
		"customer_id": fmt.Sprintf("loadgen-%d", i%100),
		"items":       []map[string]any{{"sku": g.cfg.skus[i%len(g.cfg.skus)], "quantity": g.cfg.quantity}},
	})
	r.createdAt = time.Now()
	backoff, wait, connErrs := 20*time.Millisecond, time.Duration(0), 0
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			g.retried.Add(1)
			select {
			case <-time.After(max(wait, backoff)):
			case <-ctx.Done():
				r.failed = fmt.Errorf("order %d: %w", i, ctx.Err())
				g.failed.Add(1)
				return
			}
			backoff = min(2*backoff, time.Second)
		}
		status, header, resp, err := g.do(ctx, http.MethodPost, g.cfg.orderURL+"/orders", key, body)
		wait = retryAfter(header)
		if err != nil {
			if ctx.Err() == nil && (isTimeout(err) || isConnError(err)) && connErrs < maxConnRetries {
				connErrs++
				continue // the same key again: the shop answers with the same order
			}
			r.failed = fmt.Errorf("order %d: POST /orders: %w", i, err)
			break
		}
		switch {
		case status == http.StatusOK || status == http.StatusCreated:
			var o struct {
				OrderID string `json:"order_id"`
				Status  string `json:"status"`
			}
			if err := json.Unmarshal(resp, &o); err != nil || o.OrderID == "" {
				r.failed = fmt.Errorf("POST /orders: %d with an unreadable order: %s", status, oneLine(string(resp), 200))
				break
			}
			r.id, r.status, r.created, r.createLat = o.OrderID, o.Status, true, time.Since(r.createdAt)
			g.created.Add(1)
			return
		case status == http.StatusConflict, status == http.StatusTooManyRequests, status >= 500:
			continue // the twin is still in flight, or the service is busy
		default:
			r.failed = fmt.Errorf("POST /orders: %d %s", status, oneLine(string(resp), 200))
		}
		break
	}
	g.noteErr(r.failed)
	g.failed.Add(1)
}

// follow polls order i until it settles: paid orders until COMPLETED,
// CLOSED or REJECTED (paying once it waits for payment), unpaid ones until
// they wait for payment. With -wait-complete=false it stops once paid.
func (g *loadgen) follow(ctx context.Context, i int, r *orderRun, sem chan struct{}) {
	defer g.settled.Add(1)
	pay := g.paid(i)
	paidAt := false
	interval := 25 * time.Millisecond
	for {
		switch r.status {
		case "COMPLETED":
			r.toDone = time.Since(r.createdAt)
			g.completed.Add(1)
			return
		case "CLOSED", "REJECTED":
			return
		case "WAIT_PAY":
			if !pay {
				return // stays there until the payment timeout closes it
			}
			if !paidAt {
				ok, err := g.simulate(ctx, r.id, sem)
				if err != nil {
					g.noteErr(err) // the provider refused it: it stays unpaid
					return
				}
				paidAt = ok
				if ok && !g.cfg.waitComplete {
					return
				}
			}
		case "PAID", "FULFILLING":
			if !g.cfg.waitComplete {
				return
			}
		}
		select {
		case <-time.After(interval):
		case <-ctx.Done():
			return
		}
		interval = min(interval*3/2, 250*time.Millisecond)
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		status, _, resp, err := g.do(ctx, http.MethodGet, g.cfg.orderURL+"/orders/"+r.id, "", nil)
		<-sem
		if err != nil || status != http.StatusOK {
			continue
		}
		var o struct {
			Status string `json:"status"`
		}
		if json.Unmarshal(resp, &o) == nil && o.Status != "" {
			r.status = o.Status
		}
	}
}

// simulate asks the fake provider to pay. The payment service learns of the
// order from an event, so a 404 or 409 just after WAIT_PAY means "not yet";
// a 404 that is no problem+json (net/http's plain "404 page not found")
// means the route is absent: the payment service's fake provider is off.
func (g *loadgen) simulate(ctx context.Context, id string, sem chan struct{}) (bool, error) {
	select {
	case sem <- struct{}{}:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	defer func() { <-sem }()
	status, _, resp, err := g.do(ctx, http.MethodPost, g.cfg.paymentURL+"/payments/"+id+"/simulate", "", []byte(`{"outcome":"succeeded"}`))
	switch {
	case err != nil:
		return false, nil // try again on the next round
	case status == http.StatusOK || status == http.StatusAccepted:
		return true, nil
	case status == http.StatusNotFound && bytes.HasPrefix(resp, []byte("404 page not found")):
		return false, fmt.Errorf("POST /payments/%s/simulate: the payment service does not serve it: "+
			"its fake provider is off (run it with PAYMENT_FAKE_PROVIDER=true, as shop all -demo does, or use -pay 0)", id)
	case status == http.StatusNotFound || status == http.StatusConflict || status >= 500:
		return false, nil
	}
	return false, fmt.Errorf("POST /payments/%s/simulate: %d %s", id, status, oneLine(string(resp), 200))
}

// do sends one request and reads the whole answer.
func (g *loadgen) do(ctx context.Context, method, url, key string, body []byte) (int, http.Header, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	res, err := g.client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	if err != nil {
		return 0, nil, nil, err
	}
	return res.StatusCode, res.Header, b, nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout() || errors.Is(err, context.DeadlineExceeded)
}

// isConnError reports whether err is a request that got no answer because
// of its connection: refused (the service restarting), reset or closed
// before the response was complete (the service died mid-request). The
// request may or may not have been processed, so only an idempotent retry
// is safe.
func isConnError(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// retryAfter is the wait an answer's Retry-After header asks for (in
// seconds; the HTTP-date form is not used by the shop), capped at
// maxRetryWait; 0 without one.
func retryAfter(h http.Header) time.Duration {
	secs, err := strconv.Atoi(h.Get("Retry-After"))
	if err != nil || secs < 0 {
		return 0
	}
	return min(time.Duration(secs)*time.Second, maxRetryWait)
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// progress shows how far the run is: a bar redrawn in place on a terminal,
// a line every few seconds otherwise. The returned func stops it.
func (g *loadgen) progress(start time.Time, n int) (stop func()) {
	tty := isTerminal(g.out)
	every := 5 * time.Second
	if tty {
		every = 200 * time.Millisecond
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	var rate float64 // only the progress goroutine calls line
	line := func() string {
		c, f, d := g.created.Load(), g.failed.Load(), g.completed.Load()
		el := time.Since(start)
		if c+f < int64(n) || rate == 0 {
			rate = float64(c) / max(el.Seconds(), 1e-9) // frozen once every order is created
		}
		if !g.cfg.follow { // nothing is followed: no completion to count
			return fmt.Sprintf("%d/%d created, %d failed, %.1f orders/s, %s",
				c, n, f, rate, el.Round(100*time.Millisecond))
		}
		return fmt.Sprintf("%d/%d created, %d failed, %d completed, %.1f orders/s, %s",
			c, n, f, d, rate, el.Round(100*time.Millisecond))
	}
	go func() {
		defer close(finished)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				if tty {
					fmt.Fprintf(g.out, "\r%s %s\033[K\n", bar(g.settled.Load()+g.failed.Load(), int64(n), 30), line())
				}
				return
			case <-t.C:
				if tty {
					fmt.Fprintf(g.out, "\r%s %s\033[K", bar(g.settled.Load()+g.failed.Load(), int64(n), 30), line())
				} else {
					fmt.Fprintf(g.out, "loadgen: %s\n", line())
				}
			}
		}
	}()
	return func() { close(done); <-finished }
}

// bar draws [=====>    ] for done of total.
func bar(done, total int64, width int) string {
	filled := int(float64(width) * float64(done) / float64(max(total, 1)))
	filled = min(max(filled, 0), width)
	s := strings.Repeat("=", filled)
	if filled < width {
		s += ">" + strings.Repeat(" ", width-filled-1)
	}
	return "[" + s + "]"
}

// percentile returns the nearest-rank p-th percentile of sorted ds.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func fmtDur(d time.Duration) string { return roundDuration(d).String() }

func (g *loadgen) report(runs []orderRun, start, creationEnd time.Time, total time.Duration, timedOut bool) {
	var createLat, toDone []time.Duration
	counts := map[string]int{}
	for _, r := range runs {
		switch {
		case r.created:
			createLat = append(createLat, r.createLat)
			counts[r.status]++
			if r.toDone > 0 {
				toDone = append(toDone, r.toDone)
			}
		case r.failed != nil:
			counts["(failed)"]++
		default:
			counts["(not started)"]++
		}
	}
	slices.Sort(createLat)
	slices.Sort(toDone)
	w := g.out
	rate := "unlimited"
	if g.cfg.rate > 0 {
		rate = fmt.Sprintf("%g/s", g.cfg.rate)
	}
	// Only what was measured: with -follow=false no order was paid or
	// polled, so neither the pay fraction nor a final status applies.
	pay := fmt.Sprintf(", pay %g%%", g.cfg.pay*100)
	if !g.cfg.follow {
		pay = ", -follow=false: creation only"
	}
	fmt.Fprintf(w, "\nloadgen: %d orders against %s (concurrency %d, rate %s%s), %s",
		len(runs), g.cfg.orderURL, g.cfg.concurrency, rate, pay, total.Round(time.Millisecond))
	if timedOut {
		fmt.Fprintf(w, " (stopped by -timeout %v)", g.cfg.timeout)
	}
	fmt.Fprintln(w)
	ok := len(createLat)
	fmt.Fprintf(w, "orders created:    %d ok, %d failed (%d retried requests)\n", ok, g.failed.Load(), g.retried.Load())
	if e, _ := g.firstErr.Load().(string); e != "" {
		fmt.Fprintf(w, "first error:       %s\n", e)
	}
	el := creationEnd.Sub(start)
	fmt.Fprintf(w, "creation:          %d in %s = %.1f orders/s\n", ok, el.Round(time.Millisecond), float64(ok)/max(el.Seconds(), 1e-9))
	if ok > 0 {
		fmt.Fprintf(w, "creation latency:  p50 %s  p90 %s  p99 %s  max %s\n",
			fmtDur(percentile(createLat, .5)), fmtDur(percentile(createLat, .9)), fmtDur(percentile(createLat, .99)), fmtDur(createLat[len(createLat)-1]))
	}
	if !g.cfg.follow {
		return
	}
	if len(toDone) > 0 {
		fmt.Fprintf(w, "order→COMPLETED:   %d completed  p50 %s  p99 %s  max %s\n",
			len(toDone), fmtDur(percentile(toDone, .5)), fmtDur(percentile(toDone, .99)), fmtDur(toDone[len(toDone)-1]))
	} else {
		fmt.Fprintf(w, "order→COMPLETED:   0 completed\n")
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, counts[k]))
	}
	fmt.Fprintf(w, "final status:      %s\n", strings.Join(parts, ", "))
}
