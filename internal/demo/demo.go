// Package demo is what `shop all -demo` adds to a shop: the payment
// service's fake provider switched on (Settings), a small catalogue stocked
// through the inventory service's public API (Seed), and the shell blocks
// that try it (Commands), which the README shows too.
package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/shop-ref/shop/internal/registry"
)

// Catalogue is what `shop all -demo` stocks: SKU, units, price in cents
// (deploy/seed.sh stocks the same for docker compose).
var Catalogue = []struct {
	SKU           string
	OnHand, Price int
}{
	{"SKU-1", 100, 1999},
	{"SKU-2", 50, 1299},
	{"SKU-3", 200, 499},
}

// Seed stocks the demo catalogue through the inventory service's public
// API (an operator's restock, so the order service learns it from
// ProductUpdated events like any other SKU), and prints the three shell
// blocks of Commands that place an order, pay it and watch it complete,
// once settled says the shop has taken in what the restocks published.
// urls are the base URLs this process's services really listen on (see
// app.RunDemo), so it never stocks another process that happens to answer on a
// configured address.
// A restock is an operator's call: with a token set, it is sent.
func Seed(ctx context.Context, urls map[string]string, operatorToken string, settled func(context.Context) error, out io.Writer) error {
	inv, ord, pay := urls["inventory"], urls["order"], urls["payment"]
	for _, p := range Catalogue {
		body, _ := json.Marshal(map[string]int{"on_hand": p.OnHand, "price": p.Price})
		req, err := http.NewRequestWithContext(ctx, http.MethodPut, inv+"/stock/"+p.SKU, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		if operatorToken != "" {
			req.Header.Set("Authorization", "Bearer "+operatorToken)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return fmt.Errorf("seed %s: %w", p.SKU, err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			return fmt.Errorf("seed %s: inventory answered %s", p.SKU, res.Status)
		}
	}
	// The order service learns the catalogue from inventory's events: a
	// banner printed before it has read them would invite an order the
	// shop refuses (unknown SKU) to whoever pastes step 1 at once.
	if err := settled(ctx); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	fmt.Fprintf(out, `
The demo shop is up, with SKU-1 (19.99), SKU-2 (12.99) and SKU-3 (4.99) in stock.
Try, in another terminal (sh or bash), pasting each block in order:

%s
Or watch and click in the dashboard: %s

`, Commands(ord, pay), urls["dashboard"])
	return nil
}

// Settings turns on what only a demo wants in settings, the services'
// settings of the shop's configuration: the payment service's fake
// provider. app.RunDemo calls it; `shop all -demo` calls it before it logs
// its configuration too, so that the start-up log says
// payment_fake_provider=true (it said false, then warned that it was on).
func Settings(settings *registry.Env) error {
	if err := settings.Set("PAYMENT_FAKE_PROVIDER", "true"); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	return nil
}

// Commands is the banner's three shell blocks, order's and payment's
// base URLs filled in; the README's quick start shows the same blocks with
// the default ports, and cmd/shop's TestNewcomer runs both in sh and bash.
// They use only curl and POSIX tools (no $RANDOM, which sh lacks, so every
// run would send the same key and get the first order back; no jq, no seq),
// and each loop is bounded, so a paste never hangs a terminal. The order's
// own status is the first "status" before the items' "[" (its history
// repeats every status it had).
//
// Step 2 waits for WAIT_PAY because a payment before it is refused (409
// order-not-payable): the payment intent is opened by an event, not by POST
// /orders. Step 3 polls until a final state, printing each change it sees.
func Commands(order, payment string) string {
	return strings.NewReplacer("{order}", order, "{payment}", payment).Replace(demoCommands)
}

const demoCommands = `  # 1. place an order (a unique Idempotency-Key: a retry with the same key gets the same order)
  ORDER=$(curl -s -X POST {order}/orders -H 'Content-Type: application/json' \
    -H "Idempotency-Key: demo-$(date +%s)-$$" \
    -d '{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2}]}' |
    sed -n 's/.*"order_id":"\([^"]*\)".*/\1/p'); echo "order $ORDER"

  # 2. wait until it says WAIT_PAY (up to 30s), then pay it through the fake provider
  i=0; until curl -s {order}/orders/$ORDER | grep -q '^[^[]*"status":"WAIT_PAY"' || [ $i -ge 30 ]; do
    i=$((i+1)); sleep 1; done
  curl -s -X POST {payment}/payments/$ORDER/simulate -H 'Content-Type: application/json' \
    -d '{"outcome":"succeeded"}'; echo

  # 3. watch it go WAIT_PAY → PAID → FULFILLING → COMPLETED: each change, up to 60s
  LAST=; i=0; while [ $i -lt 60 ]; do
    S=$(curl -s {order}/orders/$ORDER | sed -n 's/^[^[]*"status":"\([A-Z_]*\)".*/\1/p')
    [ "$S" = "$LAST" ] || { echo "$S"; LAST=$S; }
    case $S in COMPLETED|CLOSED|REJECTED) break;; esac
    i=$((i+1)); sleep 1; done
`
