package inventory

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/inboxtest"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/poll"
)

// orderCreated is an OrderCreated payload as the order service writes it.
func orderCreated(orderID string, items ...Item) map[string]any {
	lines := make([]map[string]any, len(items))
	var total int64
	for i, it := range items {
		lines[i] = map[string]any{"sku": it.SKU, "quantity": it.Quantity, "unit_price": 100}
		total += 100 * it.Quantity
	}
	return map[string]any{
		"order_id": orderID, "customer_id": "c-1", "items": lines,
		"total": total, "created_at": time.Now().UTC().Format(time.RFC3339),
	}
}

func orderClosed(orderID, reason string) map[string]any {
	return map[string]any{"order_id": orderID, "reason": reason}
}

func orderPaid(orderID string, items ...Item) map[string]any {
	return map[string]any{"order_id": orderID, "payment_id": "p-1", "amount": 100, "items": items}
}

func types(evs []outboxEvent) []string {
	var ts []string
	for _, e := range evs {
		ts = append(ts, e.Type)
	}
	return ts
}

// waitEvents waits until the outbox holds n events of the order.
func (f *fixture) waitEvents(t *testing.T, orderID string, n int) []outboxEvent {
	t.Helper()
	var evs []outboxEvent
	poll.Until(t, 15*time.Second, fmt.Sprintf("%d events of %s", n, orderID), func() bool {
		evs = f.events(t, orderID)
		return len(evs) >= n
	})
	return evs
}

// waitProcessed waits until the consumer has applied the order's events up to
// seq, whether or not they emitted anything.
func (f *fixture) waitProcessed(t *testing.T, orderID string, seq int64) {
	t.Helper()
	poll.Until(t, 15*time.Second, fmt.Sprintf("seq %d of %s processed", seq, orderID), func() bool {
		return inboxtest.LastSeq(t, f.pool, ConsumerName, "orders", "order", orderID) >= seq
	})
}

func TestReserveAllLines(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	f.seed(t, "B", 5, 100)
	f.runConsumer(t)

	o := uuid.NewString()
	// Two lines of A merge into one reservation.
	f.publish(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"B", 5}, Item{"A", 2}, Item{"A", 1}))
	evs := f.waitEvents(t, o, 1)
	if !slices.Equal(types(evs), []string{TypeInventoryReserved}) {
		t.Fatalf("events %v, want InventoryReserved", types(evs))
	}
	got := decode[InventoryItems](t, evs[0].Payload)
	want := InventoryItems{OrderID: o, Items: []Item{{"B", 5}, {"A", 3}}}
	if got.OrderID != want.OrderID || !slices.Equal(got.Items, want.Items) {
		t.Fatalf("InventoryReserved %+v, want %+v", got, want)
	}
	if a, b := f.stock(t, "A"), f.stock(t, "B"); a.Reserved != 3 || a.Available != 7 || b.Reserved != 5 || b.Available != 0 {
		t.Fatalf("stock A %+v, B %+v", a, b)
	}
	subject := outboxtest.RequireWritten(t, f.pool, outboxtest.Want{AggregateType: "order", AggregateID: o}).Subject
	if subject != "inventory."+o+".InventoryReserved" {
		t.Fatalf("subject %q", subject)
	}
}

func TestRejectHoldsNothing(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	f.seed(t, "B", 1, 100)
	f.runConsumer(t)

	for _, tc := range []struct {
		name    string
		items   []Item
		wantSKU string
	}{
		{"one line short", []Item{{"A", 2}, {"B", 2}}, "B"},
		{"unknown sku", []Item{{"A", 1}, {"NOPE", 1}}, "NOPE"},
		{"first short line is named", []Item{{"A", 11}, {"B", 2}}, "A"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := uuid.NewString()
			f.publish(t, o, 1, TypeOrderCreated, orderCreated(o, tc.items...))
			evs := f.waitEvents(t, o, 1)
			if !slices.Equal(types(evs), []string{TypeInventoryRejected}) {
				t.Fatalf("events %v, want InventoryRejected", types(evs))
			}
			want := InventoryRejected{OrderID: o, Reason: ReasonInsufficientStock, SKU: tc.wantSKU}
			if got := decode[InventoryRejected](t, evs[0].Payload); got != want {
				t.Fatalf("InventoryRejected %+v, want %+v", got, want)
			}
		})
	}
	if a, b := f.stock(t, "A"), f.stock(t, "B"); a.Reserved != 0 || b.Reserved != 0 {
		t.Fatalf("a rejected order holds stock: A %+v, B %+v", a, b)
	}
	if n := f.count(t, `SELECT count(*) FROM reservations`); n != 0 {
		t.Fatalf("%d reservation rows for rejected orders", n)
	}
}

func TestReleaseOnClose(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	f.runConsumer(t)

	for _, typ := range []string{TypeOrderClosed, TypeOrderRejected} {
		t.Run(typ, func(t *testing.T) {
			o := uuid.NewString()
			f.publish(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"A", 4}))
			f.waitEvents(t, o, 1)
			f.publish(t, o, 2, typ, orderClosed(o, "payment_timeout"))
			evs := f.waitEvents(t, o, 2)
			if !slices.Equal(types(evs), []string{TypeInventoryReserved, TypeInventoryReleased}) {
				t.Fatalf("events %v", types(evs))
			}
			got := decode[InventoryItems](t, evs[1].Payload)
			if got.OrderID != o || !slices.Equal(got.Items, []Item{{"A", 4}}) {
				t.Fatalf("InventoryReleased %+v", got)
			}
			if n := f.count(t, `SELECT count(*) FROM reservations WHERE order_id = $1 AND state = 'RELEASED'`, o); n != 1 {
				t.Fatalf("%d RELEASED rows", n)
			}
			// A second release (say a close after a rejection) has nothing
			// left to give back and emits nothing.
			f.publish(t, o, 3, TypeOrderClosed, orderClosed(o, "customer_cancel"))
			f.waitProcessed(t, o, 3)
			if evs := f.events(t, o); len(evs) != 2 {
				t.Fatalf("a second release emitted: %v", types(evs))
			}
		})
	}
	if a := f.stock(t, "A"); a.Reserved != 0 || a.OnHand != 10 || a.Sold != 0 {
		t.Fatalf("after release: %+v", a)
	}
}

func TestPaidCommits(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	f.seed(t, "B", 3, 100)
	f.runConsumer(t)

	o := uuid.NewString()
	f.publish(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"A", 4}, Item{"B", 3}))
	f.publish(t, o, 2, "OrderAwaitingPayment", map[string]any{"order_id": o, "total": 700})
	f.publish(t, o, 3, TypeOrderPaid, orderPaid(o, Item{"A", 4}, Item{"B", 3}))
	evs := f.waitEvents(t, o, 2)
	if !slices.Equal(types(evs), []string{TypeInventoryReserved, TypeInventoryCommitted}) {
		t.Fatalf("events %v", types(evs))
	}
	got := decode[InventoryItems](t, evs[1].Payload)
	if got.OrderID != o || !slices.Equal(got.Items, []Item{{"A", 4}, {"B", 3}}) {
		t.Fatalf("InventoryCommitted %+v", got)
	}
	for sku, want := range map[string]stockRow{
		"A": {Stock: Stock{SKU: "A", OnHand: 6, Reserved: 0, Available: 6, Sold: 4, Price: 100}, Supplied: 10},
		"B": {Stock: Stock{SKU: "B", OnHand: 0, Reserved: 0, Available: 0, Sold: 3, Price: 100}, Supplied: 3},
	} {
		got := f.stock(t, sku)
		if got != want {
			t.Errorf("stock %s = %+v, want %+v", sku, got, want)
		}
		if got.OnHand+got.Sold != got.Supplied {
			t.Errorf("stock %s not conserved: %+v", sku, got)
		}
	}

	// A close after payment (the saga would not send one, but a consumer
	// must not trust that) finds nothing reserved: sold units stay sold.
	f.publish(t, o, 4, TypeOrderClosed, orderClosed(o, "payment_timeout"))
	f.waitProcessed(t, o, 4)
	if a := f.stock(t, "A"); a.Sold != 4 || a.OnHand != 6 {
		t.Fatalf("a close after payment changed sold stock: %+v", a)
	}
}

func TestPaidAfterReleaseIsNoOp(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	o := uuid.NewString()
	for i, m := range []inbox.Message{
		message(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"A", 2})),
		message(t, o, 2, TypeOrderClosed, orderClosed(o, "payment_timeout")),
		message(t, o, 3, TypeOrderPaid, orderPaid(o, Item{"A", 2})),
	} {
		if err := f.apply(t, m); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
	if got := types(f.events(t, o)); !slices.Equal(got, []string{TypeInventoryReserved, TypeInventoryReleased}) {
		t.Fatalf("events %v: a late payment must not commit released stock", got)
	}
	if a := f.stock(t, "A"); a.OnHand != 10 || a.Reserved != 0 || a.Sold != 0 {
		t.Fatalf("stock %+v", a)
	}
}

// With the sequence check an OrderClosed cannot overtake its OrderCreated
// through the consumer, so the handler is called directly, as a requeued
// dead letter or a replay could order them.
func TestReleaseBeforeReserveLeavesTombstone(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	o := uuid.NewString()

	if err := f.apply(t, message(t, o, 2, TypeOrderClosed, orderClosed(o, "customer_cancel"))); err != nil {
		t.Fatal(err)
	}
	if evs := f.events(t, o); len(evs) != 0 {
		t.Fatalf("a release with nothing reserved emitted %v", types(evs))
	}
	if n := f.count(t, `SELECT count(*) FROM released_orders WHERE order_id = $1`, o); n != 1 {
		t.Fatal("no tombstone")
	}
	// A second release keeps one tombstone.
	if err := f.apply(t, message(t, o, 3, TypeOrderRejected, orderClosed(o, "x"))); err != nil {
		t.Fatal(err)
	}

	if err := f.apply(t, message(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"A", 3}))); err != nil {
		t.Fatal(err)
	}
	evs := f.events(t, o)
	if !slices.Equal(types(evs), []string{TypeInventoryRejected}) {
		t.Fatalf("events %v, want InventoryRejected", types(evs))
	}
	if got := decode[InventoryRejected](t, evs[0].Payload); got.Reason != ReasonReleased || got.OrderID != o {
		t.Fatalf("InventoryRejected %+v", got)
	}
	if a := f.stock(t, "A"); a.Reserved != 0 {
		t.Fatalf("a released order holds stock: %+v", a)
	}
}

func TestDuplicateDeliveryChangesNothing(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	f.runConsumer(t)

	o := uuid.NewString()
	payload := orderCreated(o, Item{"A", 2})
	id := f.publish(t, o, 1, TypeOrderCreated, payload)
	f.waitEvents(t, o, 1)
	data := []byte(fmt.Sprintf(`{"order_id":%q,"items":[{"sku":"A","quantity":2}]}`, o))
	// The same event again: once with its id (the stream's duplicate
	// window drops it) and once with a new id but its sequence number, as
	// a relay retry outside the window would look after the producer's
	// record was lost: the inbox's cursor skips it.
	f.publishRaw(t, id, o, 1, TypeOrderCreated, data)
	f.publishRaw(t, uuid.NewString(), o, 1, TypeOrderCreated, data)
	f.publish(t, o, 2, TypeOrderPaid, orderPaid(o, Item{"A", 2}))
	f.publish(t, o, 2, TypeOrderPaid, orderPaid(o, Item{"A", 2})) // a copy of seq 2 too
	f.waitProcessed(t, o, 2)
	poll.Until(t, 15*time.Second, "every copy handled", func() bool {
		info, err := f.js.Consumer(context.Background(), "ORDERS", ConsumerName)
		if err != nil {
			return false
		}
		ci, err := info.Info(context.Background())
		return err == nil && ci.NumAckPending == 0 && ci.NumPending == 0
	})
	if got := types(f.events(t, o)); !slices.Equal(got, []string{TypeInventoryReserved, TypeInventoryCommitted}) {
		t.Fatalf("events %v", got)
	}
	if a := f.stock(t, "A"); a.OnHand != 8 || a.Reserved != 0 || a.Sold != 2 {
		t.Fatalf("stock %+v", a)
	}

	// The handler itself is idempotent too: an OrderCreated for an order
	// already decided (another event id, no inbox in between) holds nothing
	// more and emits nothing.
	if err := f.apply(t, message(t, o, 1, TypeOrderCreated, payload)); err != nil {
		t.Fatal(err)
	}
	if err := f.apply(t, message(t, o, 2, TypeOrderPaid, orderPaid(o))); err != nil {
		t.Fatal(err)
	}
	if got := len(f.events(t, o)); got != 2 {
		t.Fatalf("%d events after direct duplicates", got)
	}
	if a := f.stock(t, "A"); a.OnHand != 8 || a.Reserved != 0 || a.Sold != 2 {
		t.Fatalf("stock after direct duplicates %+v", a)
	}
}

func TestConcurrentReservationsDoNotOversell(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "HOT", 20, 100)
	f.seed(t, "COLD", 1000, 100)

	const orders = 200
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := range orders {
		wg.Go(func() {
			o := fmt.Sprintf("order-%03d", i)
			// Half the orders also take another SKU, listed first, so
			// transactions lock several rows and would deadlock if they
			// locked them in line order.
			items := []Item{{"HOT", 1}}
			if i%2 == 0 {
				items = []Item{{"COLD", 1}, {"HOT", 1}}
			}
			if err := f.apply(t, message(t, o, 1, TypeOrderCreated, orderCreated(o, items...))); err != nil {
				t.Errorf("order %s: %v", o, err)
				failed.Add(1)
			}
		})
	}
	wg.Wait()
	if failed.Load() > 0 {
		t.FailNow()
	}
	hot := f.stock(t, "HOT")
	if hot.Reserved != 20 || hot.Available != 0 {
		t.Fatalf("HOT %+v, want exactly 20 reserved", hot)
	}
	reserved := len(outboxtest.Written(t, f.pool, outboxtest.Want{Type: TypeInventoryReserved}))
	rejected := len(outboxtest.Written(t, f.pool, outboxtest.Want{Type: TypeInventoryRejected}))
	if reserved != 20 || rejected != 180 {
		t.Fatalf("%d reserved, %d rejected; want 20 and 180", reserved, rejected)
	}
	// All or none: COLD is held only by orders that got HOT.
	cold := f.stock(t, "COLD")
	coldHeld := f.count(t, `SELECT count(*) FROM reservations r JOIN reservations h
		ON h.order_id = r.order_id AND h.sku = 'HOT' WHERE r.sku = 'COLD'`)
	if int(cold.Reserved) != coldHeld {
		t.Fatalf("COLD reserved %d, but only %d orders hold HOT too", cold.Reserved, coldHeld)
	}
}

func TestHandlerSkipsAndPoisons(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	o := uuid.NewString()

	// Types inventory does not act on pass, untouched.
	if err := f.apply(t, message(t, o, 1, "OrderAwaitingPayment", map[string]any{"order_id": o})); err != nil {
		t.Fatalf("OrderAwaitingPayment: %v", err)
	}
	future := message(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"A", 1}))
	future.SchemaVersion = 3
	badCurrency := message(t, o, 1, TypeOrderCreated, withCurrency(orderCreated(o, Item{"A", 1}), "euro"))
	badCurrency.SchemaVersion = 2
	closedV2 := message(t, o, 1, TypeOrderClosed, orderClosed(o, "customer_cancel"))
	closedV2.SchemaVersion = 2 // only OrderCreated has a version 2
	for name, m := range map[string]inbox.Message{
		"schema version 3":      future,
		"v2 bad currency":       badCurrency,
		"OrderClosed version 2": closedV2,
		"not JSON":              {EventID: uuid.New(), Type: TypeOrderCreated, AggregateID: o, Seq: 1, SchemaVersion: 1, Data: []byte("{")},
		"other order id":        message(t, o, 1, TypeOrderCreated, orderCreated("someone-else", Item{"A", 1})),
		"no items":              message(t, o, 1, TypeOrderCreated, orderCreated(o)),
		"zero quantity":         message(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"A", 0})),
	} {
		if err := f.apply(t, m); !errors.Is(err, inbox.ErrPoison) {
			t.Errorf("%s: err %v, want poison", name, err)
		}
	}
	outboxtest.RequireNotWritten(t, f.pool, outboxtest.Want{AggregateType: "order"})
}

// The reservation's writes are sent together after the checks; a failure
// part way through them (here a trigger refusing one reservation row after
// stock.reserved has grown for every line) must undo all of them with the
// transaction: nothing held, nothing emitted.
func TestReservationFailingHalfWayHoldsNothing(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 10, 100)
	f.seed(t, "B", 10, 100)
	for _, sql := range []string{
		`CREATE FUNCTION refuse_b() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.sku = 'B' THEN RAISE EXCEPTION 'refused by the test'; END IF;
			RETURN NEW;
		END $$`,
		`CREATE TRIGGER refuse_b BEFORE INSERT ON reservations FOR EACH ROW EXECUTE FUNCTION refuse_b()`,
	} {
		if _, err := f.pool.Exec(t.Context(), sql); err != nil {
			t.Fatal(err)
		}
	}
	o := uuid.NewString()
	created := message(t, o, 1, TypeOrderCreated, orderCreated(o, Item{"A", 2}, Item{"B", 1}))
	if err := f.apply(t, created); err == nil {
		t.Fatal("the refused reservation was applied")
	}
	if a, b := f.stock(t, "A"), f.stock(t, "B"); a.Reserved != 0 || b.Reserved != 0 {
		t.Fatalf("a failed reservation holds stock: A %+v, B %+v", a, b)
	}
	if n := f.count(t, `SELECT count(*) FROM reservations`); n != 0 {
		t.Fatalf("%d reservation rows after a failed reservation", n)
	}
	if evs := f.events(t, o); len(evs) != 0 {
		t.Fatalf("a failed reservation emitted %v", types(evs))
	}

	// The retry, once the cause is gone, holds every line.
	if _, err := f.pool.Exec(t.Context(), `DROP TRIGGER refuse_b ON reservations`); err != nil {
		t.Fatal(err)
	}
	if err := f.apply(t, created); err != nil {
		t.Fatal(err)
	}
	if a, b := f.stock(t, "A"), f.stock(t, "B"); a.Reserved != 2 || b.Reserved != 1 {
		t.Fatalf("after the retry: A %+v, B %+v", a, b)
	}
}

// Lines of one SKU are one reservation row; committing and releasing move
// their sum, and only a release that finds nothing held leaves a tombstone.
func TestSameSKULinesCommitAndRelease(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 20, 100)
	f.seed(t, "B", 20, 100)
	paid, closed := uuid.NewString(), uuid.NewString()
	for i, m := range []inbox.Message{
		message(t, paid, 1, TypeOrderCreated, orderCreated(paid, Item{"A", 2}, Item{"B", 1}, Item{"A", 3})),
		message(t, closed, 1, TypeOrderCreated, orderCreated(closed, Item{"B", 4}, Item{"B", 4})),
		message(t, paid, 2, TypeOrderPaid, orderPaid(paid)),
		message(t, closed, 2, TypeOrderClosed, orderClosed(closed, "customer_cancel")),
	} {
		if err := f.apply(t, m); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
	for _, tc := range []struct {
		orderID string
		typ     string
		items   []Item
	}{
		{paid, TypeInventoryCommitted, []Item{{"A", 5}, {"B", 1}}},
		{closed, TypeInventoryReleased, []Item{{"B", 8}}},
	} {
		evs := f.events(t, tc.orderID)
		if len(evs) != 2 || evs[1].Type != tc.typ {
			t.Fatalf("%s: events %v, want InventoryReserved and %s", tc.orderID, types(evs), tc.typ)
		}
		if got := decode[InventoryItems](t, evs[1].Payload); !slices.Equal(got.Items, tc.items) {
			t.Fatalf("%s %v, want %v", tc.typ, got.Items, tc.items)
		}
	}
	for sku, want := range map[string]stockRow{
		"A": {Stock: Stock{SKU: "A", OnHand: 15, Reserved: 0, Available: 15, Sold: 5, Price: 100}, Supplied: 20},
		"B": {Stock: Stock{SKU: "B", OnHand: 19, Reserved: 0, Available: 19, Sold: 1, Price: 100}, Supplied: 20},
	} {
		if got := f.stock(t, sku); got != want {
			t.Errorf("stock %s = %+v, want %+v", sku, got, want)
		}
	}
	if n := f.count(t, `SELECT count(*) FROM released_orders`); n != 0 {
		t.Fatalf("%d tombstones, though every release found stock held", n)
	}
	// A second close finds nothing held: now it leaves one.
	if err := f.apply(t, message(t, closed, 3, TypeOrderClosed, orderClosed(closed, "customer_cancel"))); err != nil {
		t.Fatal(err)
	}
	if n := f.count(t, `SELECT count(*) FROM released_orders WHERE order_id = $1`, closed); n != 1 {
		t.Fatalf("%d tombstones after a release with nothing held", n)
	}
	if got := types(f.events(t, closed)); len(got) != 2 {
		t.Fatalf("the second close emitted: %v", got)
	}
}

// Commits and releases lock the stock rows of their lines in SKU order
// before they change them, so concurrent ones over the same SKUs, whatever
// the order of their lines in OrderCreated, finish without a deadlock and
// leave stock conserved.
func TestConcurrentCommitsAndReleasesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	f := setup(t)
	skus := []string{"A", "B", "C", "D"}
	for _, sku := range skus {
		f.seed(t, sku, 1000, 100)
	}
	const orders = 40
	ids := make([]string, orders)
	for i := range ids {
		ids[i] = fmt.Sprintf("order-%03d", i)
		// Every order takes every SKU, starting at a different one.
		var items []Item
		for j := range skus {
			items = append(items, Item{skus[(i+j)%len(skus)], 1})
		}
		if err := f.apply(t, message(t, ids[i], 1, TypeOrderCreated, orderCreated(ids[i], items...))); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for i, o := range ids {
		wg.Go(func() {
			m := message(t, o, 2, TypeOrderPaid, orderPaid(o))
			if i%2 == 1 {
				m = message(t, o, 2, TypeOrderClosed, orderClosed(o, "payment_timeout"))
			}
			if err := f.apply(t, m); err != nil {
				t.Errorf("order %s: %v", o, err)
			}
		})
	}
	wg.Wait()
	for _, sku := range skus {
		st := f.stock(t, sku)
		if st.Reserved != 0 || st.Sold != orders/2 || st.OnHand+st.Sold != st.Supplied {
			t.Errorf("stock %s %+v, want nothing reserved and %d sold", sku, st, orders/2)
		}
	}
}

// Batches of many orders on a few shared SKUs, each order taking them in
// another order: the consumer's batch handler locks every stock row a batch
// will touch in SKU order before it decides anything, so batches of different
// workers never deadlock (without it they did, and each deadlock redid its
// batch one delivery at a time); every event is applied exactly once and
// none is dead-lettered.
func TestBatchesOnSharedSKUsDoNotDeadlock(t *testing.T) {
	t.Parallel()
	logs := &logbuf.Buffer{}
	f := setupWith(t, slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	skus := []string{"A", "B", "C", "D", "E", "F"}
	for _, sku := range skus {
		f.seed(t, sku, 1000, 100)
	}
	// Order i takes one or two SKUs, picked so that consecutive orders (the
	// ones a worker's batch holds together) lock them in changing orders.
	const orders = 240
	ids := make([]string, orders)
	sold := map[string]int64{}
	for i := range ids {
		ids[i] = fmt.Sprintf("order-%03d", i)
		items := []Item{{skus[(i*5)%len(skus)], 1}}
		if i%3 == 0 {
			items = append(items, Item{skus[(i*5+1)%len(skus)], 1})
		}
		if i%2 == 0 {
			for _, it := range items {
				sold[it.SKU]++
			}
		}
		f.publish(t, ids[i], 1, TypeOrderCreated, orderCreated(ids[i], items...))
	}
	for i, o := range ids {
		if i%2 == 0 {
			f.publish(t, o, 2, TypeOrderPaid, orderPaid(o))
		} else {
			f.publish(t, o, 2, TypeOrderClosed, orderClosed(o, "payment_timeout"))
		}
	}
	f.runConsumer(t)
	poll.Until(t, 15*time.Second, "every event is applied", func() bool {
		return len(inboxtest.Processed(t, f.pool, ConsumerName)) == 2*orders
	})
	for _, sku := range skus {
		st := f.stock(t, sku)
		if st.Reserved != 0 || st.Sold != sold[sku] || st.OnHand+st.Sold != st.Supplied {
			t.Errorf("stock %s %+v, want nothing reserved and %d sold", sku, st, sold[sku])
		}
	}
	if n := f.count(t, `SELECT count(DISTINCT order_id) FROM reservations WHERE state = 'COMMITTED'`); n != orders/2 {
		t.Errorf("%d orders committed, want %d", n, orders/2)
	}
	if n := f.count(t, `SELECT count(DISTINCT order_id) FROM reservations WHERE state = 'RELEASED'`); n != orders/2 {
		t.Errorf("%d orders released, want %d", n, orders/2)
	}
	if dead, err := inbox.ListDeadLetters(context.Background(), f.pool, ConsumerName, 10); err != nil || len(dead) != 0 {
		t.Fatalf("dead letters %+v, %v; want none", dead, err)
	}
	got := f.svc.consumer.Counters()
	if got.Processed != 2*orders || got.Batches == 0 || got.Retries != 0 {
		t.Errorf("counters %+v, want %d processed in some batches, no retries", got, 2*orders)
	}
	if text := logs.String(); strings.Contains(text, "deadlock") || strings.Contains(text, "40P01") {
		t.Errorf("a batch deadlocked:\n%s", grepLines(text, "deadlock"))
	}
}

// grepLines returns the lines of text that contain s.
func grepLines(text, s string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
