//go:build tracecheck

package tracecheck

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/ops/journey"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

var jaegerBin = flag.String("jaeger", "", "the Jaeger (v2) binary to run (make trace-check builds one and passes it)")

// jaegerConfig is the least a Jaeger v2 needs to take OTLP over HTTP and
// answer its query API: memory storage, no UI config, no telemetry of its
// own, every port the test's.
const jaegerConfig = `service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memory:
        memory:
          max_traces: 1000
  jaeger_query:
    storage:
      traces: memory
    enable_tracing: false
    http:
      endpoint: %s
    grpc:
      endpoint: %s
receivers:
  otlp:
    protocols:
      http:
        endpoint: %s
exporters:
  jaeger_storage_exporter:
    trace_storage: memory
`

// A demo order, placed, paid and followed to COMPLETED through the public
// API by a shop exporting its spans to Jaeger, reads in Jaeger's query API
// (the one its UI reads) as one trace, with a publish span for every event
// of the order, host attributes on every span and no warning on any: in
// particular none of "clock skew adjustment".
func TestJaegerShowsAnOrdersTraceCleanly(t *testing.T) {
	if *jaegerBin == "" {
		t.Fatal("needs -jaeger=<binary>: run make trace-check")
	}
	query := startJaeger(t)
	otlp := "http://" + query.otlp
	// Exported every 100ms rather than every 5s: the test waits for it.
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
	shop := shoptest.StartWith(t, services.All, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": otlp})
	sku := "traced-" + uuid.NewString()[:8]
	shop.Restock(t, sku, 10, 1000)
	id := placeAndPay(t, shop, sku)

	cfg, err := config.LoadFor(services.All, func(k string) string { return shop.Env[k] })
	if err != nil {
		t.Fatal(err)
	}
	opened, closePools, err := app.OpenShop(context.Background(), cfg.Schemas(), 2)
	if err != nil {
		t.Fatal(err)
	}
	defer closePools()
	pools := map[string]journey.DB{}
	for name, p := range opened.Pools {
		pools[name] = p
	}
	// Every event of the order, as `shop trace` shows it, must have reached
	// Jaeger as a publish span of the order's trace.
	var (
		tr      jaegerTrace
		missing []string
	)
	poll.Until(t, 30*time.Second, "every event of the order in its trace in Jaeger", func() bool {
		j, err := journey.Load(context.Background(), pools, uuid.MustParse(id))
		if err != nil {
			t.Fatal(err)
		}
		traces := query.find(t, id)
		if len(traces) > 1 {
			t.Fatalf("order %s is in %d traces in Jaeger, want one", id, len(traces))
		}
		if len(traces) == 0 {
			return false
		}
		tr = query.trace(t, traces[0])
		missing = nil
		for _, e := range j.Entries {
			if e.Kind == journey.Committed && !slices.ContainsFunc(tr.Spans, func(s jaegerSpan) bool {
				return s.OperationName == "publish "+e.EventType && s.tag("messaging.message.id") == e.EventID
			}) {
				missing = append(missing, e.Service+"/"+e.EventType)
			}
		}
		return len(missing) == 0 && len(j.Entries) > 0
	})
	for _, s := range tr.Spans {
		p := tr.Processes[s.ProcessID]
		for _, key := range []string{"host.name", "ip", "service.instance.id"} {
			if p.tag(key) == "" {
				t.Errorf("%s/%s: no process tag %s", p.ServiceName, s.OperationName, key)
			}
		}
		if len(s.Warnings) > 0 {
			t.Errorf("%s/%s: Jaeger warns %q", p.ServiceName, s.OperationName, s.Warnings)
		}
	}
	if len(tr.Warnings) > 0 {
		t.Errorf("Jaeger warns about the trace: %q", tr.Warnings)
	}
	t.Logf("order %s: trace %s in Jaeger, %d spans, %d of them publishes, no warning", id, tr.TraceID, len(tr.Spans),
		len(slices.DeleteFunc(slices.Clone(tr.Spans), func(s jaegerSpan) bool { return !strings.HasPrefix(s.OperationName, "publish ") })))
}

// jaeger is a Jaeger the test runs: where it takes OTLP, and its query API.
type jaeger struct {
	otlp, query string // host:port
}

// startJaeger runs *jaegerBin on free ports until the test ends, and
// returns once its query API answers.
func startJaeger(t *testing.T) jaeger {
	t.Helper()
	j := jaeger{otlp: shoptest.FreeAddr(t), query: shoptest.FreeAddr(t)}
	dir := t.TempDir()
	config := filepath.Join(dir, "jaeger.yaml")
	if err := os.WriteFile(config, fmt.Appendf(nil, jaegerConfig, j.query, shoptest.FreeAddr(t), j.otlp), 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd := exec.Command(*jaegerBin, "--config", "file:"+config)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("jaeger's output:\n%s", out.String())
		}
	})
	poll.Until(t, 30*time.Second, "jaeger's query API", func() bool {
		select {
		case <-exited:
			t.Fatalf("jaeger stopped: %s", out.String())
		default:
		}
		res, err := http.Get("http://" + j.query + "/api/services")
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusOK
	})
	return j
}

// find returns the ids of the traces whose order service spans carry
// shop.order_id id, as a user searches Jaeger's UI by tag.
func (j jaeger) find(t *testing.T, id string) []string {
	t.Helper()
	q := url.Values{"service": {"shop-order"}, "tags": {fmt.Sprintf(`{"shop.order_id":%q}`, id)}, "lookback": {"1h"}, "limit": {"20"}}
	var found struct{ Data []jaegerTrace }
	j.get(t, "/api/traces?"+q.Encode(), &found)
	var ids []string
	for _, tr := range found.Data {
		ids = append(ids, tr.TraceID)
	}
	return ids
}

// trace reads trace id as the UI does.
func (j jaeger) trace(t *testing.T, id string) jaegerTrace {
	t.Helper()
	var got struct{ Data []jaegerTrace }
	j.get(t, "/api/traces/"+id, &got)
	if len(got.Data) != 1 {
		t.Fatalf("GET /api/traces/%s: %d traces", id, len(got.Data))
	}
	return got.Data[0]
}

func (j jaeger) get(t *testing.T, path string, into any) {
	t.Helper()
	res, err := http.Get("http://" + j.query + path)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", path, res.Status)
	}
	if err := json.NewDecoder(res.Body).Decode(into); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
}

// jaegerTrace is a trace as Jaeger's query API (/api/traces) returns it.
type jaegerTrace struct {
	TraceID   string                   `json:"traceID"`
	Spans     []jaegerSpan             `json:"spans"`
	Processes map[string]jaegerProcess `json:"processes"`
	Warnings  []string                 `json:"warnings"`
}

type jaegerSpan struct {
	OperationName string      `json:"operationName"`
	ProcessID     string      `json:"processID"`
	Tags          []jaegerTag `json:"tags"`
	Warnings      []string    `json:"warnings"` // where the clock-skew adjuster writes
}

type jaegerProcess struct {
	ServiceName string      `json:"serviceName"`
	Tags        []jaegerTag `json:"tags"`
}

type jaegerTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

func (s jaegerSpan) tag(key string) string    { return tagOf(s.Tags, key) }
func (p jaegerProcess) tag(key string) string { return tagOf(p.Tags, key) }

func tagOf(tags []jaegerTag, key string) string {
	for _, tg := range tags {
		if tg.Key == key {
			return fmt.Sprint(tg.Value)
		}
	}
	return ""
}

// placeAndPay places an order for one sku, pays it through the demo's
// provider the moment the order says WAIT_PAY, and waits for COMPLETED, as
// a customer would; it returns the order's id.
func placeAndPay(t *testing.T, shop *shoptest.Shop, sku string) string {
	t.Helper()
	var created struct {
		OrderID string `json:"order_id"`
	}
	if status := call(t, http.MethodPost, shop.OrderURL+"/orders", map[string]string{"Idempotency-Key": "traced-" + sku},
		fmt.Sprintf(`{"customer_id":"c-1","items":[{"sku":%q,"quantity":1}]}`, sku), &created); status != http.StatusCreated {
		t.Fatalf("place order: %d", status)
	}
	waitStatus(t, shop, created.OrderID, "WAIT_PAY")
	if status := call(t, http.MethodPost, shop.URLs["payment"]+"/payments/"+created.OrderID+"/simulate", nil,
		`{"outcome":"succeeded"}`, nil); status != http.StatusOK {
		t.Fatalf("pay: %d", status)
	}
	waitStatus(t, shop, created.OrderID, "COMPLETED")
	return created.OrderID
}

func waitStatus(t *testing.T, shop *shoptest.Shop, id, want string) {
	t.Helper()
	poll.Until(t, 30*time.Second, "order "+id+" "+want, func() bool {
		var o struct{ Status string }
		call(t, http.MethodGet, shop.OrderURL+"/orders/"+id, nil, "", &o)
		return o.Status == want
	})
}

// call sends a request (shoptest.Call) and decodes a 2xx answer into into
// (when not nil); it returns the status.
func call(t *testing.T, method, url string, header map[string]string, body string, into any) int {
	t.Helper()
	status, b := shoptest.Call(t, method, url, header, body)
	if into != nil && status < 300 {
		if err := json.Unmarshal(b, into); err != nil {
			t.Fatalf("%s %s: %v", method, url, err)
		}
	}
	return status
}
