package e2e

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shop-ref/shop/ops/loadgen"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// Customers pay at moments spread around the pay_by their order shows,
// before, at and after it, through simulate and the provider's webhook,
// while shop loadgen keeps the shop busy with orders of its own. Whatever
// the payment call answered is what happened: succeeded ⇒ COMPLETED with no
// refund, refused ⇒ CLOSED with nothing kept. Payment alone decides the
// deadline, so how long the events take to reach the order changes no
// outcome. Not parallel: the load is this test's alone.
func TestPayingAroundTheDeadline(t *testing.T) {
	s := sku("deadline")
	load := sku("deadline-load")
	restock(t, s, 100, 700)
	restock(t, load, 5000, 100)

	ctx, stopLoad := context.WithCancel(context.Background())
	var out bytes.Buffer
	var wg sync.WaitGroup
	wg.Go(func() {
		// Bounded in count and time; stopped as soon as the customers are done.
		err := loadgen.Command{Services: services.All}.Run(ctx, []string{
			"-order-url", shop.order, "-payment-url", shop.payment, "-sku", load,
			"-orders", "1000", "-rate", "10", "-concurrency", "8", "-timeout", "3m",
		}, func(string) string { return "" }, &out, &out)
		if err != nil && ctx.Err() == nil {
			t.Logf("loadgen: %v", err)
		}
	})
	defer func() {
		stopLoad()
		wg.Wait()
		if lines := strings.Split(strings.TrimSpace(out.String()), "\n"); len(lines) > 0 {
			t.Logf("loadgen beside the customers (stopped when they were done): %s", lines[len(lines)-1])
		}
	}()
	time.Sleep(2 * time.Second) // the load under way before the first customer

	offsets := []time.Duration{
		-time.Second, -500 * time.Millisecond, -200 * time.Millisecond, -100 * time.Millisecond, -50 * time.Millisecond,
		0, 50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond,
	}
	paid := shoptest.Customers{OrderURL: shop.order, PaymentURL: shop.payment, WebhookSecret: webhookSecret}.
		PayAround(t, s, append(offsets, offsets...))
	stopLoad()
	shoptest.RequireAnswerIsOutcome(t, paid)
	// The load's own orders settle after it stops: those left unpaid expire
	// paymentTimeout+captureGrace after they showed WAIT_PAY, behind a
	// backlog a loaded machine takes a while to drain.
	checkInvariantsWithin(t, 3*time.Minute)
}
