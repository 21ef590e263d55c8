package app

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"

	"github.com/shop-ref/shop/internal/httpx"
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

// SeedDemo waits until the inventory and order services answer, stocks the
// demo catalogue through inventory's public API (an operator's restock, so
// the order service learns it from ProductUpdated events like any other
// SKU), and prints three curl commands that place an order, pay it and
// watch it complete.
func SeedDemo(ctx context.Context, cfg Config, out io.Writer) error {
	inv := baseURL(cfg.Services["inventory"].Addr)
	ord := baseURL(cfg.Services["order"].Addr)
	pay := baseURL(cfg.Services["payment"].Addr)
	for _, base := range []string{inv, ord, pay} {
		if err := httpx.WaitReady(ctx, nil, base); err != nil {
			return err
		}
	}
	for _, p := range demoCatalogue {
		body, _ := json.Marshal(map[string]int{"on_hand": p.onHand, "price": p.price})
		req, err := http.NewRequestWithContext(ctx, http.MethodPut, inv+"/stock/"+p.sku, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
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
  ORDER=$(curl -s -X POST %[1]s/orders -H 'Content-Type: application/json' -H "Idempotency-Key: demo-$RANDOM" \
    -d '{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2}]}' | sed -n 's/.*"order_id":"\([^"]*\)".*/\1/p'); echo $ORDER

  # 2. pay it through the built-in fake provider (it calls the signed webhook)
  curl -s -X POST %[2]s/payments/$ORDER/simulate -H 'Content-Type: application/json' -d '{"outcome":"succeeded"}'

  # 3. watch it go PENDING → WAIT_PAY → PAID → FULFILLING → COMPLETED
  curl -s %[1]s/orders/$ORDER

Or watch and click in the dashboard: %[3]s

`, ord, pay, baseURL(cfg.DashboardAddr))
	return nil
}

// baseURL turns a listen address such as ":8081" into a URL to call.
func baseURL(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil || host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return "http://" + host + ":" + port
}
