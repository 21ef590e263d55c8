package app

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
)

// demoCatalogue is what `shop all -demo` stocks: SKU, units, price in cents.
var demoCatalogue = []struct {
	sku           string
	onHand, price int
}{
	{"SKU-1", 100, 1999},
	{"SKU-2", 50, 1299},
	{"SKU-3", 200, 499},
}

// seedDemo stocks the demo catalogue through the inventory service's public
// API (an operator's restock, so the order service learns it from
// ProductUpdated events like any other SKU), and prints three curl commands
// that place an order, pay it and watch it complete. urls are the base URLs
// this process's services really listen on (see RunDemo), so it never
// stocks another process that happens to answer on a configured address.
// A restock is an operator's call: with a token set, it is sent.
func seedDemo(ctx context.Context, urls map[string]string, operatorToken string, out io.Writer) error {
	inv, ord, pay := urls["inventory"], urls["order"], urls["payment"]
	for _, p := range demoCatalogue {
		body, _ := json.Marshal(map[string]int{"on_hand": p.onHand, "price": p.price})
		req, err := http.NewRequestWithContext(ctx, http.MethodPut, inv+"/stock/"+p.sku, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		if operatorToken != "" {
			req.Header.Set("Authorization", "Bearer "+operatorToken)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return fmt.Errorf("seed %s: %w", p.sku, err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			return fmt.Errorf("seed %s: inventory answered %s", p.sku, res.Status)
		}
	}
	fmt.Fprintf(out, `
The demo shop is up, with SKU-1 (19.99), SKU-2 (12.99) and SKU-3 (4.99) in stock.
Try, in another terminal:

  # 1. place an order (the Idempotency-Key makes a retry safe)
  ORDER=$(curl -s -X POST %[1]s/orders -H 'Content-Type: application/json' -H "Idempotency-Key: demo-$(date +%%s)-$$" \
    -d '{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2}]}' | sed -n 's/.*"order_id":"\([^"]*\)".*/\1/p'); echo $ORDER

  # 2. the moment it says WAIT_PAY, pay it through the built-in fake provider (it calls the signed webhook)
  for i in $(seq 50); do curl -s %[1]s/orders/$ORDER | grep -q '"status":"WAIT_PAY"' && break; sleep 0.2; done
  curl -s -X POST %[2]s/payments/$ORDER/simulate -H 'Content-Type: application/json' -d '{"outcome":"succeeded"}'

  # 3. watch it go PENDING → WAIT_PAY → PAID → FULFILLING → COMPLETED
  curl -s %[1]s/orders/$ORDER

Or watch and click in the dashboard: %[3]s

`, ord, pay, urls["dashboard"])
	return nil
}

// listenerURL is the URL to call a listener at: an unspecified host (":8081",
// "0.0.0.0") is reached on the loopback address.
func listenerURL(ln net.Listener) string {
	host, port, err := net.SplitHostPort(ln.Addr().String())
	if err != nil {
		return "http://" + ln.Addr().String()
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}
