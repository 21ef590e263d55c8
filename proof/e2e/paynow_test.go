package e2e

import (
	"testing"

	"github.com/shop-ref/shop/proof/shoptest"
)

// What an order shows its client is what the shop honours: 40 customers
// at once, each paying the moment GET /orders/{id} says WAIT_PAY (half
// through the provider's signed webhook, half through simulate), all get
// their order, and nobody is refused or refunded. The customers look at
// the order service's answers only, as a client does.
func TestPayingTheInstantItSaysWaitPay(t *testing.T) {
	s := sku("instant")
	restock(t, s, 40, 1250)
	paid := shoptest.Customers{OrderURL: shop.order, PaymentURL: shop.payment, WebhookSecret: webhookSecret}.
		PayTheInstant(t, 40, s)
	shoptest.RequireAllCompleted(t, paid)
	checkInvariants(t)
}
