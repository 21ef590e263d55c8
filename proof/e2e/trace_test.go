package e2e

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/tracing"
	"github.com/shop-ref/shop/ops/journey"
	"github.com/shop-ref/shop/proof/poll"
)

// traceServices gives every service of cfg a tracer provider of its own,
// as a process per service would have, with the resource the shop gives
// its exporting providers (tracing.Resources), all exporting to one
// in-memory exporter, which it returns.
func traceServices(ctx context.Context, cfg config.Config) (*tracetest.InMemoryExporter, error) {
	resourceOf, err := tracing.Resources(ctx)
	if err != nil {
		return nil, err
	}
	exp := tracetest.NewInMemoryExporter()
	for _, name := range cfg.Registry.Names() {
		cfg.Services[name].TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp),
			sdktrace.WithResource(resourceOf(name)))
	}
	return exp, nil
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
	poll.Until(t, 10*time.Second, "every span of the order's trace", func() bool {
		spans, found, missing = orderTrace(id, steps)
		return missing == ""
	})
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
	spans = publishedAndTraced(t, id, found[0].SpanContext.TraceID())
	checkHops(t, spans)
	checkForATraceUI(t, spans)
	if testing.Verbose() {
		logTrace(t, spans)
	}
}

// publishedAndTraced waits until every event of order id that the order's
// journey holds (what `shop trace` reads from the outboxes) is published
// and its publish span is in the order's trace, tid, and returns that
// trace. It fails t when an event of the order is traced elsewhere: one
// order, one trace.
func publishedAndTraced(t *testing.T, id string, tid trace.TraceID) map[trace.SpanID]tracetest.SpanStub {
	t.Helper()
	oid := uuid.MustParse(id)
	pools := map[string]journey.DB{"order": shop.pools.Order, "inventory": shop.pools.Inventory,
		"payment": shop.pools.Payment, "fulfillment": shop.pools.Fulfillment}
	var (
		spans   map[trace.SpanID]tracetest.SpanStub
		missing []string
		events  int
	)
	// The last events are published just after the commit that made the
	// order COMPLETED.
	poll.Until(t, 10*time.Second, "every event of the order published, with its publish span", func() bool {
		j, err := journey.Load(context.Background(), pools, oid)
		if err != nil {
			t.Fatal(err)
		}
		spans = map[trace.SpanID]tracetest.SpanStub{}
		publishes := map[string]tracetest.SpanStub{} // by event id
		for _, s := range shop.spans.GetSpans() {
			if s.SpanContext.TraceID() == tid {
				spans[s.SpanContext.SpanID()] = s
				if s.SpanKind == trace.SpanKindProducer {
					publishes[attr(s, "messaging.message.id")] = s
				}
			} else if attr(s, "shop.order_id") == id || attr(s, "shop.aggregate_id") == id {
				t.Fatalf("span %s of order %s is in trace %s, not the order's %s", s.Name, id, s.SpanContext.TraceID(), tid)
			}
		}
		missing, events = nil, 0
		for _, e := range j.Entries {
			switch e.Kind {
			case journey.Committed:
				events++
			case journey.Published:
				p, ok := publishes[e.EventID]
				if !ok {
					missing = append(missing, e.EventType)
					continue
				}
				events--
				if p.Name != "publish "+e.EventType || serviceOf(p) != "shop-"+e.Service {
					t.Fatalf("event %s (%s of %s) has publish span %s of %s", e.EventID, e.EventType, e.Service, p.Name, serviceOf(p))
				}
			}
		}
		return len(missing) == 0 && events == 0
	})
	return spans
}

// checkHops checks the asynchronous hops of a trace: each publish span is
// a child of a span of its own service (the one whose transaction wrote
// the event), and each consumer's span a child of the publish span of the
// event it processed.
func checkHops(t *testing.T, spans map[trace.SpanID]tracetest.SpanStub) {
	t.Helper()
	for _, s := range spans {
		parent, ok := spans[s.Parent.SpanID()]
		switch {
		case !s.Parent.IsValid():
			continue
		case !ok:
			t.Errorf("span %s/%s has a parent %s not in the trace", serviceOf(s), s.Name, s.Parent.SpanID())
		case s.SpanKind == trace.SpanKindProducer && serviceOf(parent) != serviceOf(s):
			t.Errorf("%s/%s is a child of %s/%s, not of its writer in its own service", serviceOf(s), s.Name, serviceOf(parent), parent.Name)
		case s.SpanKind == trace.SpanKindConsumer && (parent.SpanKind != trace.SpanKindProducer ||
			attr(parent, "messaging.message.id") != attr(s, "messaging.message.id")):
			t.Errorf("%s/%s is a child of %s/%s, not of its event's publish", serviceOf(s), s.Name, serviceOf(parent), parent.Name)
		}
	}
}

// checkForATraceUI checks what a trace UI needs of a trace: every span says
// which host and which process instance it comes from, and Jaeger would
// flag no span of it (clockSkewWarnings).
func checkForATraceUI(t *testing.T, spans map[trace.SpanID]tracetest.SpanStub) {
	t.Helper()
	for _, s := range spans {
		for _, key := range []attribute.Key{"host.name", "ip", "service.instance.id"} {
			if v, ok := s.Resource.Set().Value(key); !ok || v.Emit() == "" {
				t.Errorf("span %s/%s has no resource attribute %s", serviceOf(s), s.Name, key)
			}
		}
	}
	for _, w := range clockSkewWarnings(spans) {
		t.Error(w)
	}
	// What keeps them unflagged is the shared host key: asynchronous hops
	// (a publish after its writer's span ended, a consumer after the
	// publish) are not within their parents. Without "ip", Jaeger would
	// flag some of them, as it did before the shop set it.
	bare := map[trace.SpanID]tracetest.SpanStub{}
	for id, s := range spans {
		s.Resource = resource.NewSchemaless(attribute.String("service.name", serviceOf(s)))
		bare[id] = s
	}
	if len(clockSkewWarnings(bare)) == 0 {
		t.Error("Jaeger's rule flags nothing in the trace even without host keys: the check above checks nothing")
	}
}

// The port of Jaeger's rule flags what Jaeger flags: a child on another
// host (or with no host key) outside its parent's interval, and the spans
// below it on its host; not a child within its parent, nor one longer than
// its parent that starts no earlier, nor any span on its parent's host.
func TestClockSkewWarningsFollowJaeger(t *testing.T) {
	t0 := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	ms := time.Millisecond
	var next byte
	span := func(parent *tracetest.SpanStub, ip string, start, end time.Duration) tracetest.SpanStub {
		next++
		s := tracetest.SpanStub{
			Name:        fmt.Sprint("s", next),
			SpanContext: trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{next}}),
			StartTime:   t0.Add(start), EndTime: t0.Add(end),
			Resource: resource.NewSchemaless(attribute.String("ip", ip)),
		}
		if parent != nil {
			s.Parent = parent.SpanContext
		}
		return s
	}
	trees := func(ss ...tracetest.SpanStub) map[trace.SpanID]tracetest.SpanStub {
		m := map[trace.SpanID]tracetest.SpanStub{}
		for _, s := range ss {
			m[s.SpanContext.SpanID()] = s
		}
		return m
	}
	root := span(nil, "a", 0, 10*ms)
	for _, c := range []struct {
		name  string
		spans map[trace.SpanID]tracetest.SpanStub
		want  int
	}{
		{"within, other host", trees(root, span(&root, "b", 2*ms, 8*ms)), 0},
		{"after, same host", trees(root, span(&root, "a", 20*ms, 21*ms)), 0},
		{"after, longer, other host", trees(root, span(&root, "b", 20*ms, 40*ms)), 0},
		{"after, shorter, other host", trees(root, span(&root, "b", 20*ms, 21*ms)), 1},
		{"after, shorter, no host key", trees(root, span(&root, "", 20*ms, 21*ms)), 1},
	} {
		if got := clockSkewWarnings(c.spans); len(got) != c.want {
			t.Errorf("%s: %d warnings %v, want %d", c.name, len(got), got, c.want)
		}
	}
	// A flagged span's delta reaches its children on its own host.
	late := span(&root, "b", 20*ms, 21*ms)
	if got := clockSkewWarnings(trees(root, late, span(&late, "b", 20*ms, 21*ms))); len(got) != 2 {
		t.Errorf("a child of a flagged span on its host: %d warnings %v, want 2", len(got), got)
	}
}

// clockSkewWarnings are the warnings Jaeger's clock-skew adjuster would put
// on the spans of a trace, as the query service behind its UI (/api/traces,
// Jaeger v1.75, max_clock_skew_adjust at its default 0) applies it: from
// each root down, a span whose host key differs from its parent's (or is
// empty) is compared with its parent, and unless it lies within the
// parent's interval, or lasts longer than the parent and starts no
// earlier, it gets a delta; the delta, never applied, is the warning, and
// the spans below it on the same host inherit it. The host key is the
// resource's "ip". A span whose parent is missing is flagged too. Times
// are in microseconds, as Jaeger stores them.
func clockSkewWarnings(spans map[trace.SpanID]tracetest.SpanStub) []string {
	children := map[trace.SpanID][]tracetest.SpanStub{}
	var roots []tracetest.SpanStub
	var warnings []string
	for _, s := range spans {
		switch _, ok := spans[s.Parent.SpanID()]; {
		case !s.Parent.IsValid():
			roots = append(roots, s)
		case ok:
			children[s.Parent.SpanID()] = append(children[s.Parent.SpanID()], s)
		default:
			roots = append(roots, s)
			warnings = append(warnings, fmt.Sprintf("%s/%s: parent %s not in the trace", serviceOf(s), s.Name, s.Parent.SpanID()))
		}
	}
	hostKey := func(s tracetest.SpanStub) string {
		v, _ := s.Resource.Set().Value("ip")
		return v.Emit()
	}
	span := func(s tracetest.SpanStub) (start, end, d int64) {
		start, d = s.StartTime.UnixMicro(), s.EndTime.Sub(s.StartTime).Microseconds()
		return start, start + d, d
	}
	skew := func(child, parent tracetest.SpanStub) int64 {
		cs, ce, cd := span(child)
		ps, pe, pd := span(parent)
		switch {
		case cd > pd && cs < ps:
			return ps - cs
		case cd > pd, cs >= ps && ce <= pe:
			return 0
		}
		return ps + (pd-cd)/2 - cs
	}
	var walk func(n tracetest.SpanStub, parent *tracetest.SpanStub, key string, delta int64)
	walk = func(n tracetest.SpanStub, parent *tracetest.SpanStub, key string, delta int64) {
		if hk := hostKey(n); parent != nil && (hk != key || hk == "") {
			key, delta = hk, skew(n, *parent)
		}
		if delta != 0 {
			warnings = append(warnings, fmt.Sprintf("%s/%s: Jaeger would flag clock skew of %dµs", serviceOf(n), n.Name, delta))
		}
		for _, c := range children[n.SpanContext.SpanID()] {
			walk(c, &n, key, delta)
		}
	}
	for _, r := range roots {
		walk(r, nil, hostKey(r), 0)
	}
	return warnings
}

// logTrace logs the spans of a trace as a tree, by start time (go test -v):
// what docs/operating.md's "Seeing a trace" shows.
func logTrace(t *testing.T, spans map[trace.SpanID]tracetest.SpanStub) {
	children := map[trace.SpanID][]tracetest.SpanStub{}
	var roots []tracetest.SpanStub
	for _, s := range spans {
		if _, ok := spans[s.Parent.SpanID()]; ok {
			children[s.Parent.SpanID()] = append(children[s.Parent.SpanID()], s)
		} else {
			roots = append(roots, s)
		}
	}
	var b strings.Builder
	var walk func(s tracetest.SpanStub, depth int)
	walk = func(s tracetest.SpanStub, depth int) {
		fmt.Fprintf(&b, "%-17s %s%s\n", serviceOf(s), strings.Repeat("  ", depth), s.Name)
		cs := children[s.SpanContext.SpanID()]
		slices.SortFunc(cs, func(a, b tracetest.SpanStub) int { return a.StartTime.Compare(b.StartTime) })
		for _, c := range cs {
			walk(c, depth+1)
		}
	}
	for _, r := range roots {
		walk(r, 0)
	}
	t.Logf("the order's trace, %d spans:\n%s", len(spans), b.String())
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
	// Nobody pays: payment expires the intent after pay_by and its grace.
	poll.Until(t, paymentTimeout+captureGrace+15*time.Second, "order "+id+" CLOSED", func() bool { return orderStatus(t, id) == "CLOSED" })
	steps := []step{
		{"order", "POST /orders", nil},
		{"order", "order STOCK_HELD → WAIT_PAY|order PAYMENT_OPEN → WAIT_PAY", []int{0}},
		{"payment", "payment intent expired", []int{0}},
		{"order", "order WAIT_PAY → CLOSED", []int{2}},
		{"inventory", "process OrderClosed", []int{3}},
	}
	var (
		spans   map[trace.SpanID]tracetest.SpanStub
		found   []tracetest.SpanStub
		missing string
	)
	poll.Until(t, 10*time.Second, "every span of the order's trace", func() bool {
		spans, found, missing = orderTrace(id, steps)
		return missing == ""
	})
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
