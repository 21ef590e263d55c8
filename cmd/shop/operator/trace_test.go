package operator

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/ops/journey"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// TestTrace runs `shop trace` against an order that went all the way to
// COMPLETED in a running shop, and checks that it names every hop: each
// event committed and published, processed by each consumer that reads it,
// and the saga's states; --json carries the same steps.
func TestTrace(t *testing.T) {
	t.Parallel()
	sh := shoptest.StartFor(t, services.All)
	sh.Restock(t, "SKU-T", 10, 500)
	cli := shopCLI{t, env(sh.Env)}

	req, _ := http.NewRequest(http.MethodPost, sh.OrderURL+"/orders",
		strings.NewReader(`{"customer_id":"c-trace","items":[{"sku":"SKU-T","quantity":1}]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "trace-"+uuid.NewString())
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var order struct {
		OrderID string `json:"order_id"`
	}
	err = json.NewDecoder(res.Body).Decode(&order)
	res.Body.Close()
	if res.StatusCode != http.StatusCreated || err != nil {
		t.Fatalf("place an order: %s %v", res.Status, err)
	}
	// Paid the moment the order says WAIT_PAY, as a customer would.
	poll.Until(t, 15*time.Second, "the order WAIT_PAY", func() bool {
		res, err := http.Get(sh.OrderURL + "/orders/" + order.OrderID)
		if err != nil {
			return false
		}
		defer res.Body.Close()
		var o struct{ Status string }
		return json.NewDecoder(res.Body).Decode(&o) == nil && o.Status == "WAIT_PAY"
	})
	payURL := "http://" + sh.Env["PAYMENT_ADDR"] + "/payments/" + order.OrderID + "/simulate"
	res, err = http.Post(payURL, "application/json", strings.NewReader(`{"outcome":"succeeded"}`))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("pay the order the moment it said WAIT_PAY: %s", res.Status)
	}

	// Every hop, as kind/event type/consumer or state. The consumers' rows
	// may come a moment after the order reaches COMPLETED.
	hops := []string{
		"state//PENDING",
		"committed/OrderCreated/", "published/OrderCreated/",
		"processed/OrderCreated/inventory-orders", "processed/OrderCreated/payment-orders",
		"committed/InventoryReserved/", "published/InventoryReserved/", "processed/InventoryReserved/order-inventory",
		"committed/PaymentOpened/", "published/PaymentOpened/", "processed/PaymentOpened/order-payment",
		"state//WAIT_PAY",
		"committed/OrderAwaitingPayment/", "processed/OrderAwaitingPayment/payment-orders",
		"committed/PaymentSucceeded/", "processed/PaymentSucceeded/order-payment",
		"state//PAID",
		"committed/OrderPaid/", "processed/OrderPaid/fulfillment-orders", "processed/OrderPaid/inventory-orders",
		"committed/FulfillmentStarted/", "processed/FulfillmentStarted/order-fulfillment",
		"state//FULFILLING",
		"committed/ShipmentDelivered/", "processed/ShipmentDelivered/order-fulfillment",
		"state//COMPLETED",
		"committed/OrderCompleted/", "published/OrderCompleted/",
	}
	type entry struct {
		Kind          string   `json:"kind"`
		Service       string   `json:"service"`
		EventType     string   `json:"event_type"`
		Consumer      string   `json:"consumer"`
		State         string   `json:"state"`
		What          string   `json:"what"`
		Hop           *float64 `json:"hop_seconds"`
		HopFrom       string   `json:"hop_from"`
		SincePrevious float64  `json:"since_previous_seconds"`
	}
	type trace struct {
		OrderID string  `json:"order_id"`
		Status  string  `json:"status"`
		Entries []entry `json:"entries"`
	}
	var j trace
	var missing []string
	poll.Until(t, 30*time.Second, "every hop of the order", func() bool {
		j = trace{} // omitted fields must not keep the values of the last read
		cli.json(&j, "trace", order.OrderID, "--json")
		seen := map[string]bool{}
		for _, e := range j.Entries {
			seen[e.Kind+"/"+e.EventType+"/"+e.Consumer+e.State] = true
		}
		missing = missing[:0]
		for _, h := range hops {
			if !seen[h] {
				missing = append(missing, h)
			}
		}
		if len(missing) > 0 {
			t.Logf("not yet: %v", missing)
		}
		return j.Status == "COMPLETED" && len(missing) == 0
	})
	for _, e := range j.Entries {
		if (e.Kind == "published" || e.Kind == "processed") && (e.Hop == nil || e.HopFrom == "") {
			t.Errorf("%s: no hop time", e.What)
		}
	}

	out := cli.ok("trace", order.OrderID)
	t.Logf("shop trace %s:\n%s", order.OrderID, out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if !strings.HasPrefix(lines[0], "order "+order.OrderID+": COMPLETED") {
		t.Errorf("first line %q", lines[0])
	}
	if h := strings.Fields(lines[1]); len(h) < 4 || h[0] != "TIME" || h[1] != "+DELTA" || h[2] != "SERVICE" || h[3] != "WHAT" {
		t.Errorf("header %q", lines[1])
	}
	// Aligned: the service column starts at the same offset on every line.
	col := strings.Index(lines[1], "SERVICE")
	for _, want := range []string{
		"OrderCreated committed (seq 1)",
		"OrderCreated published by the relay (",
		"OrderCreated processed by inventory-orders (",
		"OrderCreated processed by payment-orders (",
		"InventoryReserved committed (seq 1)",
		"InventoryReserved processed by order-inventory (",
		"PaymentOpened processed by order-payment (",
		"state PENDING → WAIT_PAY (payable)",
		"PaymentSucceeded processed by order-payment (",
		"OrderPaid processed by fulfillment-orders (",
		"state FULFILLING → COMPLETED (shipment_delivered)",
	} {
		var line string
		for _, l := range lines[2:] {
			if strings.Contains(l, want) {
				line = l
				break
			}
		}
		if line == "" {
			t.Errorf("no line says %q:\n%s", want, out)
			continue
		}
		if svc := strings.Fields(line[col:])[0]; len(line) <= col || line[col-1] != ' ' || !strings.Contains("order inventory payment fulfillment", svc) {
			t.Errorf("line %q: the service column does not start at %d", line, col)
		}
	}
	if len(lines)-2 != len(j.Entries) {
		t.Errorf("%d lines of steps, --json has %d entries", len(lines)-2, len(j.Entries))
	}

	t.Run("an unknown order", func(t *testing.T) {
		id := uuid.NewString()
		_, _, err := cli.run("trace", id)
		if err == nil || !strings.Contains(err.Error(), "no order "+id) {
			t.Errorf("got %v, want it to say there is no such order", err)
		}
	})
}

// writeJourney's other lines: an order the order service does not know,
// armed timeouts (due and overdue) and the notes.
func TestWriteJourney(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 1, 9, 30, 0, 0, time.UTC)
	j := journey.Journey{
		OrderID: "o-1",
		Entries: []journey.Entry{
			{At: at, Kind: journey.Committed, Service: "payment", What: "PaymentSucceeded committed (seq 1)"},
			{At: at.Add(3 * time.Millisecond), Kind: journey.Published, Service: "payment", What: "PaymentSucceeded published by the relay",
				SincePrevious: 3 * time.Millisecond, Hop: 3 * time.Millisecond, HopFrom: journey.Committed},
		},
		Timeouts: []journey.Timeout{{Name: "payment", DueAt: time.Now().Add(time.Hour)}, {Name: "reservation", DueAt: time.Now().Add(-time.Minute)}},
		Notes:    []string{"order: the order's events before seq 3 are gone"},
	}
	var out strings.Builder
	if err := writeJourney(&out, j); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := []string{
		"order o-1: unknown to the order service (2 steps, 2026-12-01 UTC)",
		"TIME             +DELTA  SERVICE  WHAT",
		"09:30:00.000000          payment  PaymentSucceeded committed (seq 1)",
		"09:30:00.003000  +3ms    payment  PaymentSucceeded published by the relay (3ms after committed)",
		"armed: the saga's payment timeout, due ",
		"armed: the saga's reservation timeout, due ",
		"note: order: the order's events before seq 3 are gone",
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), len(want), out.String())
	}
	for i := range want {
		if !strings.HasPrefix(lines[i], want[i]) {
			t.Errorf("line %d:\n got %q\nwant %q", i, lines[i], want[i])
		}
	}
	if !strings.Contains(lines[4], "(in 1h0m0s)") && !strings.Contains(lines[4], "(in 59m59s)") {
		t.Errorf("the payment timeout: %q", lines[4])
	}
	if !strings.Contains(lines[5], "overdue by 1m0s") {
		t.Errorf("the reservation timeout: %q", lines[5])
	}
}
