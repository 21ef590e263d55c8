package app

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
)

// metricNames are the metrics every service serves, and sagaMetricNames
// those only the order service adds.
var (
	metricNames = []string{
		"shop_outbox_backlog_events",
		"shop_outbox_oldest_pending_age_seconds",
		"shop_outbox_dead_events",
		"shop_outbox_published_events_total",
		"shop_outbox_publish_failures_total",
		"shop_outbox_events_made_dead_total",
		"shop_outbox_expired_leases_total",
		"shop_outbox_lost_leases_total",
		"shop_outbox_publish_latency_seconds",
		"shop_consumer_processed_total",
		"shop_consumer_duplicates_total",
		"shop_consumer_retries_total",
		"shop_consumer_dead_letters_total",
		"shop_consumer_processing_seconds",
		"shop_consumer_lag_messages",
		"shop_nats_connected",
		"shop_jetstream_up",
		"shop_outbox_broker_unavailable",
		"shop_outbox_broker_outages_total",
		"shop_outbox_deferred_events_total",
		"shop_outbox_seconds_since_last_publish",
		"shop_outbox_relay_streaming",
		"shop_outbox_cdc_unavailable",
		"shop_outbox_handed_off_events_total",
		"shop_outbox_slot_lag_bytes", // the default relay mode is cdc: every service has its slot
		"shop_outbox_slot_wal_held_bytes",
		"shop_postgres_oldest_transaction_age_seconds",
		"shop_outbox_slot_lag_age_seconds",
		"shop_outbox_slot_safe_wal_size_bytes",
		"shop_outbox_slot_wal_status",
		"shop_consumer_subscribed",
		"shop_consumer_stale_total",
		"shop_consumer_conflicts_total",
		"shop_consumer_parked_total",
		"shop_consumer_parked_events",
		"shop_consumer_oldest_parked_age_seconds",
		"shop_consumer_resubscribes_total",
		"shop_consumer_seconds_since_last_delivery",
		"shop_http_requests_total",
		"shop_http_request_errors_total",
		"shop_http_request_duration_seconds",
	}
	sagaMetricNames = []string{
		"shop_saga_instances",
		"shop_saga_timeouts_fired_total",
	}
)

// scrape is one /metrics answer: the metric names its TYPE lines declare and
// its samples, keyed by the sample line up to the value.
type scrape struct {
	names   map[string]bool
	samples map[string]float64
}

func scrapeMetrics(t *testing.T, base string) scrape {
	t.Helper()
	res, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.HasPrefix(res.Header.Get("Content-Type"), "text/plain") {
		body, _ := io.ReadAll(res.Body)
		t.Fatalf("GET /metrics = %s %q: %s", res.Status, res.Header.Get("Content-Type"), body)
	}
	s := scrape{names: map[string]bool{}, samples: map[string]float64{}}
	sc := bufio.NewScanner(res.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if name, ok := strings.CutPrefix(line, "# TYPE "); ok {
			s.names[strings.Fields(name)[0]] = true
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("sample %q: %v", line, err)
		}
		s.samples[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return s
}

// value returns the sample of metric name whose labels include every one
// of labels (`consumer="order-inventory"`), and whether there is one.
func (s scrape) value(name string, labels ...string) (float64, bool) {
next:
	for k, v := range s.samples {
		if k != name && !strings.HasPrefix(k, name+"{") {
			continue
		}
		for _, l := range labels {
			if !strings.Contains(k, l) {
				continue next
			}
		}
		return v, true
	}
	return 0, false
}

// startServices runs the named services' relays and domains, each on a
// schema of its own and all on one NATS server, and returns their HTTP base
// URLs by name.
func startServices(t *testing.T, names ...string) map[string]string {
	t.Helper()
	ns := natstest.New(t)
	nc, js := ns.Connect(t)
	cfg, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	urls := map[string]string{}
	var runs []func()
	for _, name := range names {
		e, err := cfg.Registry.Get(name)
		if err != nil {
			t.Fatal(err)
		}
		pool := pgtest.New(t, e.Sets()...).NewPool(t, e.PoolSize)
		s, err := New(name, cfg, nc, log)
		if err != nil {
			t.Fatal(err)
		}
		relay, dom, h, err := s.assemble(pool, js)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(h)
		t.Cleanup(srv.Close)
		urls[name] = srv.URL
		runs = append(runs, func() {
			wg.Go(func() { _ = relay.Run(ctx) })
			wg.Go(func() { _ = dom.Run(ctx) })
		})
	}
	// Registered after the pools and servers, so it runs before they close.
	t.Cleanup(func() { cancel(); wg.Wait() })
	streamCtx, cancelStreams := context.WithTimeout(ctx, 10*time.Second)
	defer cancelStreams()
	if err := ensureEveryStream(streamCtx, js, log); err != nil || streamCtx.Err() != nil {
		t.Fatalf("ensure streams: %v %v", err, streamCtx.Err())
	}
	for _, run := range runs {
		run()
	}
	return urls
}

// do sends one JSON request and fails the test unless it is answered with want.
func do(t *testing.T, method, url, body string, want int, header ...string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode != want {
		msg, _ := io.ReadAll(res.Body)
		t.Fatalf("%s %s = %s, want %d: %s", method, url, res.Status, want, msg)
	}
}

// waitMetrics scrapes the inventory and order services until ok holds.
func waitMetrics(t *testing.T, urls map[string]string, what string, ok func(inv, ord scrape) bool) (inv, ord scrape) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		inv, ord = scrapeMetrics(t, urls["inventory"]), scrapeMetrics(t, urls["order"])
		if ok(inv, ord) {
			return inv, ord
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting until %s\ninventory: %v\norder: %v", what, inv.samples, ord.samples)
		}
		time.Sleep(50 * time.Millisecond) // polling a condition, not waiting blindly
	}
}

func TestMetrics(t *testing.T) {
	t.Parallel()
	urls := startServices(t, "inventory", "order")

	// One event: stocking a product commits an inventory event to the
	// outbox; its relay publishes it and the order service consumes it.
	do(t, http.MethodPut, urls["inventory"]+"/stock/SKU-M", `{"on_hand": 5, "price": 100}`, http.StatusOK)
	waitMetrics(t, urls, "the stock event is published and consumed", func(inv, ord scrape) bool {
		published, _ := inv.value("shop_outbox_published_events_total")
		backlog, ok := inv.value("shop_outbox_backlog_events")
		processed, _ := ord.value("shop_consumer_processed_total", `consumer="order-inventory"`)
		return published >= 1 && ok && backlog == 0 && processed >= 1
	})

	// An order starts a saga; it comes to rest with its stock held, waiting
	// for payment (which does not run here) to open the payment intent,
	// every outbox empty and every consumer caught up. The saga's join
	// state shows in the metric by its name.
	do(t, http.MethodPost, urls["order"]+"/orders", `{"customer_id": "c-1", "items": [{"sku": "SKU-M", "quantity": 1}]}`,
		http.StatusCreated, "Idempotency-Key", "metrics-1")
	inv, ord := waitMetrics(t, urls, "the order's saga rests and the outboxes are empty", func(inv, ord scrape) bool {
		invBacklog, ok1 := inv.value("shop_outbox_backlog_events")
		ordBacklog, ok2 := ord.value("shop_outbox_backlog_events")
		waiting, _ := ord.value("shop_saga_instances", `state="STOCK_HELD"`)
		lag := 0.0
		for _, c := range []string{"order-inventory", "order-payment", "order-fulfillment"} {
			n, ok := ord.value("shop_consumer_lag_messages", `consumer="`+c+`"`)
			if !ok {
				return false
			}
			lag += n
		}
		return ok1 && ok2 && invBacklog == 0 && ordBacklog == 0 && waiting == 1 && lag == 0
	})

	t.Run("every service serves every metric", func(t *testing.T) {
		for name, s := range map[string]scrape{"inventory": inv, "order": ord} {
			want := metricNames
			if name == "order" {
				want = append(want[:len(want):len(want)], sagaMetricNames...)
			}
			for _, m := range want {
				if !s.names[m] {
					t.Errorf("%s: /metrics has no %s", name, m)
				}
			}
			if _, ok := s.value("shop_outbox_backlog_events", `service="`+name+`"`); !ok {
				t.Errorf("%s: metrics lack the service label", name)
			}
		}
		if inv.names["shop_saga_instances"] {
			t.Error("inventory reports saga instances; it runs no saga")
		}
	})

	t.Run("the event moved the counters", func(t *testing.T) {
		if n, _ := inv.value("shop_outbox_publish_latency_seconds_count"); n < 1 {
			t.Errorf("inventory publish latency count = %v, want >= 1", n)
		}
		if n, _ := ord.value("shop_consumer_processing_seconds_count", `consumer="order-inventory"`); n < 1 {
			t.Errorf("order-inventory processing latency count = %v, want >= 1", n)
		}
		if lag, _ := ord.value("shop_consumer_lag_messages", `consumer="order-inventory"`); lag != 0 {
			t.Errorf("order-inventory lag = %v, want 0 once the event is processed", lag)
		}
	})

	t.Run("requests are counted by route pattern", func(t *testing.T) {
		if n, _ := inv.value("shop_http_requests_total", `route="/stock/{sku}"`, `method="PUT"`, `code="200"`); n != 1 {
			t.Errorf("PUT /stock/{sku} 200 count = %v, want 1", n)
		}
		if n, ok := inv.value("shop_http_request_errors_total", `route="/stock/{sku}"`, `method="PUT"`); !ok || n != 0 {
			t.Errorf("PUT /stock/{sku} errors = %v (present: %v), want a 0", n, ok)
		}
	})
}
