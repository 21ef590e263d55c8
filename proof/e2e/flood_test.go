package e2e

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
)

// floodEvents early messages of other orders — sequence 2 of orders whose
// sequence 1 never comes, as a hostile peer would send them, or as the later
// events of orders stuck behind dead letters pile up.
const floodEvents = 10_000

// Early messages hold no one back: before parking, they stayed in the
// durable consumers' ack-pending sets (1,000 by default, shared by every
// order), so that a thousand of them stopped every delivery and admission
// shed every POST /orders with no end. Now they are parked and acked; a
// fresh order completes and is not shed. Its time beside a normal order's
// is logged, not asserted (the machine is shared).
func TestEarlyMessagesDoNotStopTheShop(t *testing.T) {
	s := sku("flood")
	restock(t, s, 10, 100)
	normal := completeOrder(t, s)

	_, js := shop.nats.ConnectAs(t, "order") // the flood is the order service's, as a buggy one would send it
	start := time.Now()
	natstest.PublishAll(t, js, floodEvents, func(i int) (*nats.Msg, string) {
		e := natstest.Event{Prefix: "orders", AggregateType: "order", AggregateID: fmt.Sprint("flood-", i),
			Type: "OrderCreated", Seq: 2, Payload: map[string]any{"order_id": fmt.Sprint("flood-", i)}}
		m := e.Msg(t)
		return m, m.Header.Get(jetstream.MsgIDHeader)
	})
	ctx := context.Background()
	parked := func() (inv, pay int) {
		q := `SELECT count(*) FROM inbox_parked WHERE aggregate_id LIKE 'flood-%' AND discarded_at IS NULL`
		if err := shop.pools.Inventory.QueryRow(ctx, q).Scan(&inv); err != nil {
			t.Fatal(err)
		}
		if err := shop.pools.Payment.QueryRow(ctx, q).Scan(&pay); err != nil {
			t.Fatal(err)
		}
		return inv, pay
	}
	poll.Until(t, 5*time.Minute, "every early message parked by inventory and payment", func() bool {
		inv, pay := parked()
		return inv == floodEvents && pay == floodEvents
	})
	parking := time.Since(start)
	// A message is acked after the commit that parks it: the last batch's
	// acks may still be on their way when the rows show, so the consumers
	// get a moment to come down to what is in flight.
	for _, c := range []string{"inventory-orders", "payment-orders"} {
		cons, err := js.Consumer(ctx, "ORDERS", c)
		if err != nil {
			t.Fatal(err)
		}
		poll.Until(t, 30*time.Second, c+" holds only what is in flight unacknowledged with the flood parked", func() bool {
			info, err := cons.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			return info.NumAckPending <= 100
		})
	}
	flooded := completeOrder(t, s)
	t.Logf("order→COMPLETED %v normally, %v with %d early messages parked (parking them took %v)",
		normal.Round(time.Millisecond), flooded.Round(time.Millisecond), floodEvents, parking.Round(time.Millisecond))

	// As an operator would, once they are known to be garbage.
	const discard = `UPDATE inbox_parked SET discarded_at = now(), discard_reason = 'e2e flood' WHERE aggregate_id LIKE 'flood-%'`
	for _, pool := range []*pgxpool.Pool{shop.pools.Inventory, shop.pools.Payment} {
		if _, err := pool.Exec(ctx, discard); err != nil {
			t.Fatal(err)
		}
	}
	checkInvariants(t)
}

// completeOrder places an order of one unit of sku, pays it and waits until
// it is COMPLETED; it returns how long that took. Admission must not shed it.
func completeOrder(t *testing.T, sku string) time.Duration {
	t.Helper()
	start := time.Now()
	r := placeOrder(t, "flood-"+randHex(), item(sku, 1))
	if r.status != http.StatusCreated {
		t.Fatalf("place order: %d %s", r.status, r.raw)
	}
	id := r.body["order_id"].(string)
	waitStatus(t, id, "WAIT_PAY")
	// Paid the moment it says WAIT_PAY, as a customer would.
	if pay := do(t, "POST", shop.payment+"/payments/"+id+"/simulate", nil, map[string]string{"outcome": "succeeded"}); pay.status != http.StatusOK {
		t.Fatalf("simulate payment: %d %s", pay.status, pay.raw)
	}
	waitStatus(t, id, "COMPLETED")
	return time.Since(start)
}
