package verify_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// What a forged OrderPaid leaves behind — a shipment and sold stock for an
// order nobody paid — is a violation that names the order and the event
// that announced the shipment or the sale; a paid order's are not.
func TestVerifyNamesAShipmentWithoutPayment(t *testing.T) {
	t.Parallel()
	pools := shoptest.Schemas(t, services.All)
	ctx := context.Background()
	exec := func(service, sql string, args ...any) {
		t.Helper()
		if _, err := pools.Pools[service].Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %s: %v", service, sql, err)
		}
	}
	// The forged order: shipped and sold, announced, never paid.
	forged, paid := uuid.NewString(), uuid.NewString()
	shipped, sold := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	exec("inventory", `INSERT INTO stock (sku, on_hand, reserved, sold, price, supplied) VALUES ('SKU-1', 6, 0, 4, 100, 10)`)
	for _, order := range []string{forged, paid} {
		exec("fulfillment", `INSERT INTO shipments (order_id, shipment_id, state, items, deliver_at, delivered_at)
			VALUES ($1, $2, 'DELIVERED', '[{"sku":"SKU-1","quantity":2}]', now(), now())`, order, uuid.New())
		exec("inventory", `INSERT INTO reservations (order_id, sku, quantity, state) VALUES ($1, 'SKU-1', 2, 'COMMITTED')`, order)
	}
	exec("fulfillment", `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version, subject, payload, published_at)
		VALUES ($1, 'order', $2, 1, 'FulfillmentStarted', 1, 'fulfillment.' || $2 || '.FulfillmentStarted', '{}', now())`, shipped, forged)
	exec("inventory", `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version, subject, payload, published_at)
		VALUES ($1, 'order', $2, 1, 'InventoryCommitted', 1, 'inventory.' || $2 || '.InventoryCommitted', '{}', now())`, sold, forged)
	// The paid order: a succeeded payment, an intent PAID.
	exec("payment", `INSERT INTO intents (order_id, state, amount) VALUES ($1, 'PAID', 200)`, paid)
	exec("payment", `INSERT INTO payments (payment_id, order_id, provider_payment_id, status, amount)
		VALUES ($1, $2, 'pay_1', 'succeeded', 200)`, uuid.Must(uuid.NewV7()), paid)
	// A failed payment pays for nothing.
	exec("payment", `INSERT INTO intents (order_id, state, amount) VALUES ($1, 'PAYABLE', 200)`, forged)
	exec("payment", `INSERT INTO payments (payment_id, order_id, provider_payment_id, status, amount)
		VALUES ($1, $2, 'pay_2', 'failed', 200)`, uuid.Must(uuid.NewV7()), forged)

	rep, err := verify.Run(ctx, pools, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	v := map[string][]string{}
	for _, c := range rep.Checks {
		v[c.Name] = c.Violations
	}
	for name, want := range map[string]string{
		"payment: no shipment without a succeeded payment of its order":   "order " + forged + ": shipped (FulfillmentStarted " + shipped.String() + ") without a succeeded payment",
		"payment: no stock sold without a succeeded payment of its order": "order " + forged + ": sold stock (InventoryCommitted " + sold.String() + ") without a succeeded payment",
	} {
		if len(v[name]) != 1 || v[name][0] != want {
			t.Errorf("%s: %q, want [%q]", name, v[name], want)
		}
	}

	// Once its outbox row is gone (retention), the violation stays and says so.
	exec("fulfillment", `DELETE FROM outbox WHERE event_id = $1`, shipped)
	rep, err = verify.Run(ctx, pools, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range rep.Checks {
		if c.Name == "payment: no shipment without a succeeded payment of its order" {
			if want := "order " + forged + ": shipped (FulfillmentStarted no longer in the outbox) without a succeeded payment"; len(c.Violations) != 1 || c.Violations[0] != want {
				t.Errorf("%q, want [%q]", c.Violations, want)
			}
		}
	}
}
