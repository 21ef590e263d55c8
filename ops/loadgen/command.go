package loadgen

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/registry"
)

// config is what the flags of shop loadgen set.
type config struct {
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

// Command is `shop loadgen` for the services of Services (services.All,
// which cmd/shop passes): of their configuration it needs only where the
// order and payment services listen, each entry's Addr unless ORDER_ADDR
// or PAYMENT_ADDR says otherwise.
type Command struct{ Services registry.Registry }

// Run is `shop loadgen [flags]`: it checks its flags (a mistake, or a
// target that is not this machine, is a usage error), fails fast when no
// shop answers, then places the orders, showing its progress on stdout,
// and prints the report. It returns an error when an order failed, when
// -timeout stopped it first, or when ctx ended.
func (c Command) Run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	addr := func(service string) string {
		e, _ := c.Services.Get(service) // a shop without it: an empty default, and a flag to give
		return cmp.Or(getenv(strings.ToUpper(service)+"_ADDR"), e.Addr)
	}
	var lc config
	var skus skuList
	fs := flag.NewFlagSet("shop loadgen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, `Usage: shop loadgen [flags]

Drives orders through the public HTTP API of a local shop: each order is a
POST /orders with its own Idempotency-Key (a timed-out request is retried with
the same key); a fraction is paid through POST /payments/{id}/simulate the
moment GET /orders/{id} says WAIT_PAY (a refused payment is counted and fails
the run: the shop promises to take it) (the payment service serves it only with its fake
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
	fs.StringVar(&lc.orderURL, "order-url", localURL(addr("order")), "base `URL` of the order service (default from ORDER_ADDR)")
	fs.StringVar(&lc.paymentURL, "payment-url", localURL(addr("payment")), "base `URL` of the payment service (default from PAYMENT_ADDR)")
	fs.DurationVar(&lc.timeout, "timeout", 2*time.Minute, "stop after this long, finished or not")
	fs.DurationVar(&lc.requestTimeout, "request-timeout", 10*time.Second, "timeout of one HTTP request (a timed-out order creation is retried with the same key)")
	fs.BoolVar(&lc.waitComplete, "wait-complete", true, "follow each paid order to COMPLETED (or CLOSED/REJECTED) to measure order-to-COMPLETED")
	fs.BoolVar(&lc.follow, "follow", true, "poll each created order (GET /orders/{id}) to pay it and see it settle; false: only create orders, pay none, and measure POST /orders alone")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("loadgen: %v: %w", err, cli.ErrUsage)
	}
	bad := func(format string, args ...any) error {
		msg := fmt.Sprintf(format, args...)
		fmt.Fprintf(stderr, "shop loadgen: %s\n", msg)
		return fmt.Errorf("loadgen: %s: %w", msg, cli.ErrUsage)
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
	var err error
	if lc.orderURL, err = checkLocal("order-url", lc.orderURL); err != nil {
		return bad("%v", err)
	}
	if lc.paymentURL, err = checkLocal("payment-url", lc.paymentURL); err != nil {
		return bad("%v", err)
	}

	g := newGenerator(lc, stdout)
	if err := g.preflight(ctx); err != nil {
		return err
	}
	return g.run(ctx)
}
