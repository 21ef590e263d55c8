package e2e

import (
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/app"
)

// traceServices gives every service of cfg a tracer provider of its own,
// as a process per service would have, all exporting to one in-memory
// exporter, which it returns.
func traceServices(cfg app.Config) *tracetest.InMemoryExporter {
	exp := tracetest.NewInMemoryExporter()
	for _, name := range cfg.Registry.Names() {
		cfg.Services[name].TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp),
			sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "shop-"+name))))
	}
	return exp
}

// One order is one trace: from the POST /orders that creates it, through
// the outbox and the consumers of all four services, the payment callback
// and the delivery, to the saga's COMPLETED, each span caused by the one
// before it in the saga's order.
func TestOneOrderIsOneTrace(t *testing.T) {
	s := sku("traced")
	restock(t, s, 10, 1000)
	r := placeOrder(t, "traced-"+randHex(), item(s, 1))
	if r.status != http.StatusCreated {
		t.Fatalf("place order: %d %s", r.status, r.raw)
	}
	id := r.body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")
	if pay := do(t, "POST", shop.payment+"/payments/"+id+"/simulate", nil, map[string]string{"outcome": "succeeded"}); pay.status != http.StatusOK {
		t.Fatalf("simulate payment: %d %s", pay.status, pay.raw)
	}
	waitStatus(t, id, "COMPLETED")

	// Each step, and the step that caused it: its span must descend from
	// that one's, and start after it. Inventory and payment answer
	// OrderCreated in parallel; the saga moves to WAIT_PAY in the span of
	// the second answer, whichever it is (a name of either join state, a
	// cause of either answer). The provider's callback continues the trace
	// kept with the intent, which payment opened on OrderCreated.
	steps := []step{
		{"order", "POST /orders", nil},
		{"inventory", "process OrderCreated", []int{0}},
		{"payment", "process OrderCreated", []int{0}},
		{"order", "process InventoryReserved", []int{1}},
		{"order", "process PaymentOpened", []int{2}},
		{"order", "order STOCK_HELD → WAIT_PAY|order PAYMENT_OPEN → WAIT_PAY", []int{3, 4}},
		{"payment", "payment callback", []int{2}},
		{"order", "process PaymentSucceeded", []int{6}},
		{"order", "order WAIT_PAY → PAID", []int{7}},
		{"fulfillment", "process OrderPaid", []int{8}},
		{"order", "process FulfillmentStarted", []int{9}},
		{"order", "order PAID → FULFILLING", []int{10}},
		{"fulfillment", "deliver shipment", []int{9}},
		{"order", "process ShipmentDelivered", []int{12}},
		{"order", "order FULFILLING → COMPLETED", []int{13}},
	}
	var (
		spans   map[trace.SpanID]tracetest.SpanStub
		found   []tracetest.SpanStub
		missing string
	)
	// The last spans end just after the commit that made the order COMPLETED.
	deadline := time.Now().Add(10 * time.Second)
	for {
		spans, found, missing = orderTrace(id, steps)
		if missing == "" || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if missing != "" {
		t.Fatalf("no span %s in the order's trace (%d spans)", missing, len(spans))
	}
	if found[0].Parent.IsValid() {
		t.Errorf("POST /orders has a parent %s; want the trace's root", found[0].Parent.SpanID())
	}
	services := map[string]bool{}
	for i, st := range steps {
		got := found[i]
		services[serviceOf(got)] = true
		if len(st.causes) == 0 {
			continue
		}
		var cause *tracetest.SpanStub
		for _, c := range st.causes {
			if descends(spans, got, found[c].SpanContext.SpanID()) {
				cause = &found[c]
			}
		}
		if cause == nil {
			t.Errorf("%s/%s does not descend from %s", st.service, st.name, steps[st.causes[0]].name)
			continue
		}
		if got.StartTime.Before(cause.StartTime) {
			t.Errorf("%s/%s started before its cause %s", st.service, st.name, cause.Name)
		}
	}
	if len(services) != 4 {
		t.Errorf("the trace spans services %v, want all four", services)
	}
	for _, st := range found {
		if (st.SpanKind == trace.SpanKindInternal || st.SpanKind == trace.SpanKindServer) && attr(st, "shop.order_id") == "" && serviceOf(st) == "shop-order" {
			t.Errorf("span %s of the order service has no shop.order_id", st.Name)
		}
	}
}

// A timeout belongs to its order's trace too: the payment deadline fires
// minutes (here seconds) after the transition that armed it, and continues
// that transition's trace.
func TestATimeoutContinuesItsOrdersTrace(t *testing.T) {
	s := sku("traced-timeout")
	restock(t, s, 10, 1000)
	r := placeOrder(t, "traced-timeout-"+randHex(), item(s, 1))
	if r.status != http.StatusCreated {
		t.Fatalf("place order: %d %s", r.status, r.raw)
	}
	id := r.body["order_id"].(string)
	waitStatus(t, id, "CLOSED") // nobody pays: the payment timeout closes it
	steps := []step{
		{"order", "POST /orders", nil},
		{"order", "order STOCK_HELD → WAIT_PAY|order PAYMENT_OPEN → WAIT_PAY", []int{0}},
		{"order", "saga timeout payment", []int{1}},
		{"order", "order WAIT_PAY → CLOSED", []int{2}},
		{"inventory", "process OrderClosed", []int{3}},
	}
	var (
		spans   map[trace.SpanID]tracetest.SpanStub
		found   []tracetest.SpanStub
		missing string
	)
	deadline := time.Now().Add(10 * time.Second)
	for {
		spans, found, missing = orderTrace(id, steps)
		if missing == "" || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if missing != "" {
		t.Fatalf("no span %s in the order's trace (%d spans)", missing, len(spans))
	}
	for i, st := range steps[1:] {
		if c := st.causes[0]; !descends(spans, found[i+1], found[c].SpanContext.SpanID()) {
			t.Errorf("%s/%s does not descend from %s/%s", st.service, st.name, steps[c].service, steps[c].name)
		}
	}
}

// step is a span an order's trace must hold: its service, its name (or
// names, separated by "|") and the steps that may have caused it.
type step struct {
	service, name string
	causes        []int
}

// orderTrace finds the trace of order id, the one its POST /orders span
// started, and in it the span of each step; missing names the first step
// without one.
func orderTrace(id string, steps []step) (spans map[trace.SpanID]tracetest.SpanStub, found []tracetest.SpanStub, missing string) {
	all := shop.spans.GetSpans()
	var tid trace.TraceID
	for _, s := range all {
		if s.Name == "POST /orders" && attr(s, "shop.order_id") == id {
			tid = s.SpanContext.TraceID()
		}
	}
	spans = map[trace.SpanID]tracetest.SpanStub{}
	for _, s := range all {
		if s.SpanContext.TraceID() == tid {
			spans[s.SpanContext.SpanID()] = s
		}
	}
	for _, st := range steps {
		var first *tracetest.SpanStub
		for _, s := range spans {
			if !slices.Contains(strings.Split(st.name, "|"), s.Name) || serviceOf(s) != "shop-"+st.service || attr(s, "shop.inbox.outcome") == "duplicate" {
				continue
			}
			if first == nil || s.StartTime.Before(first.StartTime) {
				first = &s
			}
		}
		if first == nil {
			return spans, found, st.service + "/" + st.name
		}
		found = append(found, *first)
	}
	return spans, found, ""
}

// descends reports whether s has ancestor among spans.
func descends(spans map[trace.SpanID]tracetest.SpanStub, s tracetest.SpanStub, ancestor trace.SpanID) bool {
	for range len(spans) {
		if !s.Parent.IsValid() {
			return false
		}
		if s.Parent.SpanID() == ancestor {
			return true
		}
		var ok bool
		if s, ok = spans[s.Parent.SpanID()]; !ok {
			return false
		}
	}
	return false
}

func serviceOf(s tracetest.SpanStub) string {
	v, _ := s.Resource.Set().Value("service.name")
	return v.AsString()
}

func attr(s tracetest.SpanStub, key attribute.Key) string {
	for _, a := range s.Attributes {
		if a.Key == key {
			return a.Value.Emit()
		}
	}
	return ""
}
