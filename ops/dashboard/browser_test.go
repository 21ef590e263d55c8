package dashboard_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/shop-ref/shop/proof/browser"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/ops/dashboard"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// TestBrowser runs the whole shop as `shop all` does, opens the dashboard in
// headless Chromium and does what a visitor would: place an order with a
// click, pay it with a click, watch it reach COMPLETED on the page, and
// click it to see its journey: every hop of its events, each consumer's
// included, and the saga's states.
//
// Set DASHBOARD_SCREENSHOT=$PWD/docs/dashboard.png to keep a picture of the
// page at the end, with its charts and health strip, and
// JOURNEY_SCREENSHOT=$PWD/docs/journey.png one of the journey panel's
// waterfall (a relative path is relative to this package's directory): that
// is how the README's pictures are taken.
func TestBrowser(t *testing.T) {
	t.Parallel()
	chromium := findChromium(t)
	begin := time.Now()
	sh := startShop(t, true)
	restock(t, sh, "SKU-1")
	t.Logf("shop up and SKU-1 on sale after %v", time.Since(begin).Round(time.Millisecond))

	alloc, cancel := browser.Allocator(context.Background(), chromium, t.TempDir(), 1400, 900)
	defer cancel()
	ctx, cancel := chromedp.NewContext(alloc)
	defer cancel()
	ctx, cancel = context.WithTimeout(ctx, 90*time.Second)
	defer cancel()

	// A script error on the page fails the test even when the clicks work.
	var (
		mu         sync.Mutex
		exceptions []string
	)
	err := chromedp.Listen(ctx, func(ev any) {
		if e, ok := ev.(*runtime.EventExceptionThrown); ok {
			mu.Lock()
			exceptions = append(exceptions, (&chromedp.ExceptionError{ExceptionDetails: e.ExceptionDetails}).Error())
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatalf("start chromium: %v", err)
	}

	step := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		start := time.Now()
		if err := chromedp.Do(ctx, actions...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Logf("%s: %v", what, time.Since(start).Round(time.Millisecond))
	}
	// The page must work under its own Content-Security-Policy: a script,
	// style or request it blocks is recorded (this script is injected by
	// the browser, which the policy does not govern) and fails the test.
	step("record what the content-security policy blocks",
		func(ctx context.Context, t *chromedp.Target) (chromedp.Void, error) {
			_, err := cdp.Call(ctx, t, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{
				Source: `window.cspViolations = [];
					document.addEventListener("securitypolicyviolation",
						(e) => window.cspViolations.push(e.violatedDirective + " " + e.blockedURI));`})
			return chromedp.Void{}, err
		},
	)
	step("open the page and see it live",
		chromedp.Navigate(sh.dashboard),
		chromedp.WaitVisible(chromedp.CSS(`#conn.live`)),
		chromedp.WaitVisible(chromedp.CSS(`#col-CLOSED li[data-order-id]`)), // restock's probe order
	)
	healthy := []chromedp.Action[chromedp.Void]{}
	for _, name := range services.All.Names() {
		healthy = append(healthy, chromedp.WaitVisible(chromedp.CSS(`#health li.ok[data-service="`+name+`"]`)))
	}
	step("see every service ready in the health strip", healthy...)
	probe, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(`#col-CLOSED li[data-order-id] .reason`)))
	if err != nil || probe != "reason: customer_cancel" {
		t.Errorf("the cancelled probe order's card says %q (%v), want its reason", probe, err)
	}
	step(`click "Place an order"`,
		chromedp.Click(chromedp.CSS(`#place`)),
		chromedp.WaitVisible(chromedp.CSS(`#message[data-order-id]:not([data-order-id=""])`)),
	)
	attr, err := chromedp.Run(ctx, chromedp.AttributeValue(chromedp.CSS(`#message`), "data-order-id"))
	if err != nil || attr.Value == "" {
		t.Fatalf("the page names no placed order: %v", err)
	}
	orderID := attr.Value
	card := `li[data-order-id="` + orderID + `"]`
	step(`wait for WAIT_PAY and click "Pay"`,
		chromedp.Click(chromedp.CSS(`#col-WAIT_PAY `+card+` button.pay`)),
	)
	step("wait for COMPLETED",
		chromedp.WaitVisible(chromedp.CSS(`#col-COMPLETED `+card)),
	)
	href, err := chromedp.Run(ctx, chromedp.AttributeValue(chromedp.CSS(`#col-COMPLETED `+card+` a.trace`), "href"))
	if err != nil || !regexp.MustCompile(`^http://traces\.example/trace/[0-9a-f]{32}$`).MatchString(href.Value) {
		t.Errorf("the order's trace link is %q (%v), want TRACE_UI_URL with its trace id", href.Value, err)
	}
	message, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(`#message`)))
	if err != nil || !strings.Contains(message, "Paid order "+orderID) {
		t.Errorf("message %q (%v): want it to say the order was paid", message, err)
	}

	// The consumers' rows may come a moment after COMPLETED shows: the
	// open panel is read again with every update until they are there.
	hops := []string{
		`[data-kind="state"][data-state="PENDING"]`,
		`[data-kind="committed"][data-event-type="OrderCreated"]`,
		`[data-kind="published"][data-event-type="OrderCreated"]`,
		`[data-kind="processed"][data-event-type="OrderCreated"][data-consumer="inventory-orders"]`,
		`[data-kind="processed"][data-event-type="OrderCreated"][data-consumer="payment-orders"]`,
		`[data-kind="processed"][data-event-type="InventoryReserved"][data-consumer="order-inventory"]`,
		`[data-kind="processed"][data-event-type="PaymentSucceeded"][data-consumer="order-payment"]`,
		`[data-kind="processed"][data-event-type="OrderPaid"][data-consumer="fulfillment-orders"]`,
		`[data-kind="processed"][data-event-type="ShipmentDelivered"][data-consumer="order-fulfillment"]`,
		`[data-kind="state"][data-state="COMPLETED"]`,
	}
	journeyActions := []chromedp.Action[chromedp.Void]{
		chromedp.Click(chromedp.CSS(`#col-COMPLETED ` + card + ` .id`)),
		chromedp.WaitVisible(chromedp.CSS(`#journey`)),
	}
	// The table is folded under the waterfall: its rows are there, not shown.
	for _, h := range hops {
		journeyActions = append(journeyActions, chromedp.WaitReady(chromedp.CSS(`#journey-entries tr`+h)))
	}
	// The waterfall: a row per event, a bar per consumer, the states as marks.
	for _, w := range []string{
		`.wrow.event[data-event-type="OrderCreated"] .bar.publish`,
		`.wrow.hop[data-event-type="OrderCreated"][data-consumer="inventory-orders"] .bar.processed`,
		`.wrow.hop[data-event-type="ShipmentDelivered"][data-consumer="order-fulfillment"] .bar.processed`,
		`.mark[data-state="PENDING"]`,
		`.mark[data-state="COMPLETED"]`,
	} {
		journeyActions = append(journeyActions, chromedp.WaitVisible(chromedp.CSS(`#waterfall `+w)))
	}
	step("click the order and see its journey", journeyActions...)
	timeline, err := chromedp.Run(ctx, chromedp.TextContent(chromedp.CSS(`#journey`)))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{orderID, "COMPLETED", "OrderCreated processed by inventory-orders", "after published",
		"OrderCreated published by the relay", "after committed", "state FULFILLING → COMPLETED (shipment_delivered)"} {
		if !strings.Contains(timeline, want) {
			t.Errorf("the journey panel lacks %q:\n%s", want, timeline)
		}
	}
	if path := os.Getenv("JOURNEY_SCREENSHOT"); path != "" {
		// Unfolded, the table would make the picture a scroll; the
		// waterfall is what it shows.
		png, err := chromedp.Run(ctx, chromedp.Screenshot(chromedp.CSS(`#journey`)))
		if err == nil {
			err = os.WriteFile(path, png, 0o644)
		}
		if err != nil {
			t.Errorf("journey screenshot: %v", err)
		}
	}
	step("close the journey", chromedp.Click(chromedp.CSS(`#journey-close`)))

	// A few more orders, placed and paid with clicks, so that the charts
	// have completions to draw.
	for i := range 3 {
		step(fmt.Sprintf("place and pay order %d more", i+1),
			chromedp.Click(chromedp.CSS(`#place`)),
			chromedp.WaitVisible(chromedp.CSS(`#message[data-order-id]:not([data-order-id="`+orderID+`"])`)),
		)
		attr, err := chromedp.Run(ctx, chromedp.AttributeValue(chromedp.CSS(`#message`), "data-order-id"))
		if err != nil || attr.Value == "" {
			t.Fatalf("the page names no placed order: %v", err)
		}
		orderID = attr.Value
		card := `li[data-order-id="` + orderID + `"]`
		step("pay it and see it COMPLETED",
			chromedp.Click(chromedp.CSS(`#col-WAIT_PAY `+card+` button.pay`)),
			chromedp.WaitVisible(chromedp.CSS(`#col-COMPLETED `+card)),
		)
	}
	// The charts: a canvas each, and the data they plot (window.chartData,
	// what uPlot was given) holds completions, their latency, and a backlog
	// and a lag series per service, all read by the dashboard's sampler.
	step("see the charts drawn with data",
		chromedp.WaitVisible(chromedp.CSS(`#chart-completed canvas`)),
		chromedp.WaitVisible(chromedp.CSS(`#chart-latency canvas`)),
		chromedp.WaitVisible(chromedp.CSS(`#chart-backlog canvas`)),
		chromedp.WaitVisible(chromedp.CSS(`#chart-lag canvas`)),
		// A column of times, then a series per service of the registry.
		chromedp.Poll[chromedp.Void](strings.ReplaceAll(`(() => {
			const d = window.chartData || {};
			const some = (col, f) => Array.isArray(col) && col.some(f);
			return some((d["chart-completed"] || [])[1], (v) => v > 0)
				&& some((d["chart-latency"] || [])[1], (v) => v > 0)
				&& some((d["chart-latency"] || [])[2], (v) => v > 0)
				&& (d["chart-backlog"] || []).length === COLUMNS && some(d["chart-backlog"][1], (v) => v !== null)
				&& (d["chart-lag"] || []).length === COLUMNS && some(d["chart-lag"][1], (v) => v !== null);
		})()`, "COLUMNS", strconv.Itoa(len(services.All)+1)), chromedp.WithPollingInterval(200*time.Millisecond)),
	)
	if path := os.Getenv("DASHBOARD_SCREENSHOT"); path != "" {
		// The README's picture: charts with something to show, and an
		// order's journey open, so that one picture has the health strip,
		// the charts and the waterfall.
		traffic(t, sh, 30)
		step("see the traffic completed on the page",
			chromedp.Poll[chromedp.Void](`Number(document.querySelector("#col-COMPLETED .count").textContent) >= 34
				&& ((window.chartData || {})["chart-completed"] || [[], []])[1].some((v) => v >= 5)`,
				chromedp.WithPollingInterval(200*time.Millisecond)),
		)
		step("open a journey for the picture",
			chromedp.Click(chromedp.CSS(`#col-COMPLETED li[data-order-id] .id`)),
			chromedp.WaitVisible(chromedp.CSS(`#waterfall .mark[data-state="COMPLETED"]`)),
		)
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err == nil {
			err = os.WriteFile(path, png, 0o644)
		}
		if err != nil {
			t.Errorf("screenshot: %v", err)
		}
	}
	violations, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`window.cspViolations`))
	if err != nil {
		t.Errorf("read the policy's violations: %v", err)
	}
	for _, v := range violations {
		t.Errorf("the content-security policy blocked %s", v)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, e := range exceptions {
		t.Errorf("script error on the page: %s", e)
	}
	t.Logf("browser test took %v", time.Since(begin).Round(time.Millisecond))
}

// findChromium returns Chromium's path. Its absence fails the test rather
// than skipping it, so that a CI without it cannot pass silently.
func findChromium(t *testing.T) string {
	t.Helper()
	path, err := browser.Find()
	if err != nil {
		t.Fatalf("the dashboard's browser test needs Chromium: %v", err)
	}
	return path
}

type shopURLs struct{ dashboard, order, inventory string }

// TestClientTraceparentIsNoTraceLink: with tracing off, a client sends
// POST /orders with a traceparent of its choosing. The shop records no
// trace, so the dashboard must not link the order to that one (or any).
func TestClientTraceparentIsNoTraceLink(t *testing.T) {
	t.Parallel()
	sh := startShop(t, false)
	restock(t, sh, "SKU-1")
	status, body := shoptest.Call(t, "POST", sh.order+"/orders", map[string]string{"Idempotency-Key": "k-" + randHex(),
		"Traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`)
	var o struct {
		OrderID string `json:"order_id"`
	}
	if status != http.StatusCreated || json.Unmarshal(body, &o) != nil {
		t.Fatalf("POST /orders: %d %s", status, body)
	}
	var st dashboard.State
	poll.Until(t, 10*time.Second, "the order on the dashboard", func() bool {
		st = getState(t, sh.dashboard)
		return slices.ContainsFunc(st.Orders, func(x dashboard.Order) bool { return x.ID == o.OrderID })
	})
	for _, x := range st.Orders {
		if x.TraceURL != "" {
			t.Errorf("order %s links to %s; with tracing off no order has a trace", x.ID, x.TraceURL)
		}
	}
}

// startShop runs every service and the dashboard in this process, as `shop
// all` does, over a throwaway database and a test NATS server, and waits
// until they serve. traced: the order service records spans (kept in
// memory, exported nowhere); otherwise tracing is off, as without
// OTEL_EXPORTER_OTLP_ENDPOINT.
func startShop(t *testing.T, traced bool) shopURLs {
	t.Helper()
	dbURL := throwawayDatabase(t)
	nats := natstest.New(t)
	env := map[string]string{
		"DATABASE_URL":          dbURL,
		"NATS_URL":              nats.URL(),
		"PAYMENT_TIMEOUT":       "1m",
		"FULFILLMENT_DELAY":     "200ms",
		"DASHBOARD_ADDR":        freeAddr(t),
		"PAYMENT_FAKE_PROVIDER": "true", // the page's Pay button
		"DASHBOARD_DEMO":        "true", // its Place and Pay buttons
		"TRACE_UI_URL":          "http://traces.example/trace/{trace_id}",
	}
	for _, name := range services.All.Names() {
		env[strings.ToUpper(name)+"_ADDR"] = freeAddr(t)
	}
	cfg, err := config.LoadFor(services.All, func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	if traced {
		// Its outbox rows carry a traceparent, and the page links the trace.
		tp := sdktrace.NewTracerProvider()
		t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		cfg.Services["order"].TracerProvider = tp
	}
	log := slog.New(slog.DiscardHandler)
	if os.Getenv("DASHBOARD_TEST_LOG") != "" {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, cfg, cfg.Registry.Names(), log) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("shop: %v", err)
		}
	})
	for _, name := range cfg.Registry.Names() {
		poll.Until(t, 30*time.Second, name+" ready", func() bool {
			return get("http://"+env[strings.ToUpper(name)+"_ADDR"]+"/readyz") == http.StatusOK
		})
	}
	sh := shopURLs{
		dashboard: "http://" + env["DASHBOARD_ADDR"],
		order:     "http://" + env["ORDER_ADDR"],
		inventory: "http://" + env["INVENTORY_ADDR"],
	}
	poll.Until(t, 30*time.Second, "dashboard state", func() bool { return get(sh.dashboard+"/api/state") == http.StatusOK })
	return sh
}

// restock puts sku on sale and waits until the order service has learned
// it from ProductUpdated: until then an order for it is refused. The probe
// order that gets through is cancelled.
func restock(t *testing.T, sh shopURLs, sku string) {
	t.Helper()
	if status, body := shoptest.Call(t, "PUT", sh.inventory+"/stock/"+sku, nil, `{"on_hand":100,"price":1999}`); status != http.StatusOK {
		t.Fatalf("restock %s: %d %s", sku, status, body)
	}
	var probe struct {
		OrderID string `json:"order_id"`
	}
	poll.Until(t, 10*time.Second, "the order service knows "+sku, func() bool {
		status, body := shoptest.Call(t, "POST", sh.order+"/orders", map[string]string{"Idempotency-Key": "probe-" + randHex()},
			`{"customer_id":"c-1","items":[{"sku":"`+sku+`","quantity":1}]}`)
		return status == http.StatusCreated && json.Unmarshal(body, &probe) == nil
	})
	if status, body := shoptest.Call(t, "POST", sh.order+"/orders/"+probe.OrderID+"/cancel", nil, ""); status != http.StatusAccepted {
		t.Fatalf("cancel the probe order: %d %s", status, body)
	}
}

// throwawayDatabase returns the URL of a database of its own, dropped when
// the test ends: the services use fixed schema names.
func throwawayDatabase(t *testing.T) string {
	t.Helper()
	name := "shop_dashboard_" + randHex()
	u, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := database.EnsureExists(ctx, u.String()); err != nil {
		t.Fatalf("test database (set TEST_DATABASE_URL to use another): %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, pgtest.URL())
		if err != nil {
			t.Errorf("drop %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop %s: %v", name, err)
		}
	})
	return u.String()
}

func get(url string) int {
	res, err := http.Get(url)
	if err != nil {
		return 0
	}
	res.Body.Close()
	return res.StatusCode
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// traffic places n orders through the dashboard's own demo API, as its
// button does, and pays each once the order service says WAIT_PAY, as the
// page's Pay button does: completions for the charts to draw.
func traffic(t *testing.T, sh shopURLs, n int) {
	t.Helper()
	var ids []string
	for range n {
		status, body := shoptest.Call(t, "POST", sh.dashboard+"/api/demo/order", nil, "")
		var o struct {
			OrderID string `json:"order_id"`
		}
		if status != http.StatusCreated || json.Unmarshal(body, &o) != nil {
			t.Fatalf("place an order through the dashboard: %d %s", status, body)
		}
		ids = append(ids, o.OrderID)
	}
	for _, id := range ids {
		poll.Until(t, 30*time.Second, "order "+id+" says WAIT_PAY", func() bool {
			_, body := shoptest.Call(t, "GET", sh.order+"/orders/"+id, nil, "")
			var o struct {
				Status string `json:"status"`
			}
			return json.Unmarshal(body, &o) == nil && o.Status == "WAIT_PAY"
		})
		if status, body := shoptest.Call(t, "POST", sh.dashboard+"/api/demo/pay/"+id, nil, ""); status != http.StatusOK {
			t.Fatalf("pay %s through the dashboard: %d %s", id, status, body)
		}
	}
}

func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
