package reconcile_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/ops/reconcile"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// shop is every service's freshly migrated schema, each in its own test
// schema, as `shop all` would have them.
type shop struct {
	t     *testing.T
	shop  verify.Shop
	pools struct{ Order, Inventory, Payment, Fulfillment *pgxpool.Pool }
}

func newShop(t *testing.T) *shop {
	t.Helper()
	t.Parallel()
	s := &shop{t: t, shop: shoptest.Schemas(t, services.All)}
	s.pools.Order, s.pools.Inventory = s.shop.Pools["order"], s.shop.Pools["inventory"]
	s.pools.Payment, s.pools.Fulfillment = s.shop.Pools["payment"], s.shop.Pools["fulfillment"]
	return s
}

func (s *shop) exec(pool *pgxpool.Pool, sql string, args ...any) {
	s.t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		s.t.Fatalf("%s: %v", sql, err)
	}
}

// order creates an order that entered status ago (a Postgres interval) and
// its saga instance with data.
func (s *shop) order(status, ago, data string) string {
	s.t.Helper()
	id := uuid.NewString()
	s.exec(s.pools.Order, `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at)
		VALUES ($1, 'c-1', $2, 1000, now() - $3::interval - interval '1 minute', now() - $3::interval)`, id, status, ago)
	s.exec(s.pools.Order, `INSERT INTO order_history (order_id, status, at) VALUES
		($1, 'PENDING', now() - $3::interval - interval '1 minute'), ($1, $2, now() - $3::interval)`, id, status, ago)
	s.exec(s.pools.Order, `INSERT INTO saga_instances (id, type, state, data) VALUES ($1, 'order', $2, $3)`, id, status, data)
	return id
}

// event puts a published event about order id into producer's outbox,
// published ago, and returns its id.
func (s *shop) event(producer *pgxpool.Pool, id string, seq int, typ, ago string) uuid.UUID {
	s.t.Helper()
	ev := uuid.Must(uuid.NewV7())
	s.exec(producer, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
		schema_version, subject, payload, occurred_at, published_at)
		VALUES ($1, 'order', $2, $3, $4, 1, 'x.' || $2 || '.' || $4, '{}', now() - $5::interval, now() - $5::interval)`,
		ev, id, seq, typ, ago)
	return ev
}

func (s *shop) processed(pool *pgxpool.Pool, consumer string, ev uuid.UUID) {
	s.t.Helper()
	s.exec(pool, `INSERT INTO processed_events (consumer_name, event_id) VALUES ($1, $2)`, consumer, ev)
}

// reached records ev as processed by every consumer of stream in the
// registry (a new service's too), but those named in except.
func (s *shop) reached(stream string, ev uuid.UUID, except ...string) {
	s.t.Helper()
	for _, r := range services.All.Readers() {
		if r.Stream == stream && !slices.Contains(except, r.Name) {
			s.processed(s.shop.Pools[r.Service], r.Name, ev)
		}
	}
}

func (s *shop) published(pool *pgxpool.Pool, ev uuid.UUID) bool {
	s.t.Helper()
	rec, err := outbox.Get(context.Background(), pool, ev)
	if err != nil {
		s.t.Fatal(err)
	}
	return rec.PublishedAt != nil
}

func (s *shop) run(repair bool) reconcile.Report {
	s.t.Helper()
	rep, err := reconcile.Run(context.Background(), s.shop, reconcile.Config{Repair: repair})
	if err != nil {
		s.t.Fatal(err)
	}
	var b strings.Builder
	rep.Write(&b)
	s.t.Log("\n" + b.String())
	return rep
}

// found returns the order ids of rep's findings of kind k, sorted.
func found(rep reconcile.Report, k reconcile.Kind) []string {
	var ids []string
	for _, f := range rep.Findings {
		if f.Kind == k {
			ids = append(ids, f.OrderID)
		}
	}
	slices.Sort(ids)
	return ids
}

func sorted(ids ...string) []string { slices.Sort(ids); return ids }

func TestStuckOrders(t *testing.T) {
	s := newShop(t)
	pendingLong := s.order("PENDING", "10 minutes", "{}")
	s.order("PENDING", "1 minute", "{}")
	// WAIT_PAY with an overdue timeout (the scanner did not fire), and one
	// with no timeout armed and past PAYMENT_TIMEOUT (15m) + grace (5m).
	overdue := s.order("WAIT_PAY", "30 minutes", "{}")
	s.exec(s.pools.Order, `INSERT INTO saga_timeouts (saga_id, name, due_at) VALUES ($1, 'payment', now() - interval '10 minutes')`, overdue)
	unarmed := s.order("WAIT_PAY", "25 minutes", "{}")
	// A timeout the scanner keeps failing on and rescheduling: its pay-by
	// (entry + 15m) is long past.
	rescheduled := s.order("WAIT_PAY", "25 minutes", "{}")
	s.exec(s.pools.Order, `INSERT INTO saga_timeouts (saga_id, name, due_at) VALUES ($1, 'payment', now() + interval '1 minute')`, rescheduled)
	waiting := s.order("WAIT_PAY", "10 minutes", "{}") // its timeout is still ahead
	s.exec(s.pools.Order, `INSERT INTO saga_timeouts (saga_id, name, due_at) VALUES ($1, 'payment', now() + interval '5 minutes')`, waiting)
	s.order("WAIT_PAY", "18 minutes", "{}") // past pay-by, within the grace
	paidLong := s.order("PAID", "2 hours", "{}")
	s.order("FULFILLING", "30 minutes", "{}")
	s.order("CLOSED", "3 hours", "{}")

	// The stuck PENDING order: its OrderCreated reached every consumer of
	// ORDERS; the reply InventoryReserved was lost on the way to
	// order-inventory; a later one is still inside JetStream's duplicate
	// window, where a copy would be dropped, so it is left alone.
	created := s.event(s.pools.Order, pendingLong, 1, "OrderCreated", "20 minutes")
	s.reached("ORDERS", created)
	reserved := s.event(s.pools.Inventory, pendingLong, 1, "InventoryReserved", "15 minutes")
	// A stuck PAID order whose OrderPaid fulfillment-orders dead-lettered:
	// a copy would only park again, so it is reported, not republished.
	paidEv := s.event(s.pools.Order, paidLong, 1, "OrderPaid", "2 hours")
	s.reached("ORDERS", paidEv, "fulfillment-orders")
	s.exec(s.pools.Fulfillment, `INSERT INTO dead_letters (consumer_name, stream, stream_seq, subject, headers, payload,
		event_id, error, attempts, first_failed_at, last_failed_at)
		VALUES ('fulfillment-orders', 'ORDERS', 7, 'orders.x.OrderPaid', '{}', '', $1, 'poison', 1, now(), now())`, paidEv)
	recent := s.event(s.pools.Inventory, pendingLong, 2, "InventoryReserved", "1 minute")

	rep := s.run(false)
	if got, want := found(rep, reconcile.StuckOrder), sorted(pendingLong, overdue, unarmed, rescheduled, paidLong); !slices.Equal(got, want) {
		t.Fatalf("stuck orders = %v, want %v", got, want)
	}
	if rep.Counts.StuckOrders != 5 || rep.Counts.Republished != 0 {
		t.Fatalf("counts = %+v", rep.Counts)
	}
	if !s.published(s.pools.Inventory, reserved) {
		t.Fatal("a report-only run republished an event")
	}

	rep = s.run(true)
	if rep.Counts.Republished != 1 {
		t.Fatalf("republished %d events, want 1 (the lost InventoryReserved)", rep.Counts.Republished)
	}
	if s.published(s.pools.Inventory, reserved) {
		t.Error("the lost InventoryReserved is still marked published")
	}
	if !s.published(s.pools.Order, created) {
		t.Error("OrderCreated, processed by inventory-orders, was republished")
	}
	if !s.published(s.pools.Order, paidEv) {
		t.Error("OrderPaid, dead-lettered by fulfillment-orders, was republished")
	}
	if !s.published(s.pools.Inventory, recent) {
		t.Error("an event inside the duplicate window was republished")
	}
	for _, f := range rep.Findings {
		if f.OrderID == pendingLong && f.Republished != 1 {
			t.Errorf("finding %v: republished %d, want 1", f, f.Republished)
		}
	}
}

func TestUnrefundedPayments(t *testing.T) {
	s := newShop(t)
	pay := func(order, ago string) string {
		id := uuid.NewString()
		s.exec(s.pools.Payment, `INSERT INTO intents (order_id, state, amount) VALUES ($1, 'PAYABLE', 1000)
			ON CONFLICT DO NOTHING`, order)
		s.exec(s.pools.Payment, `INSERT INTO payments (payment_id, order_id, provider_payment_id, status, amount, created_at)
			VALUES ($1::uuid, $2, $1::text, 'succeeded', 1000, now() - $3::interval)`, id, order, ago)
		return id
	}
	// Captured for a closed order whose PaymentSucceeded never reached the
	// order saga: the repair republishes it from payment's outbox.
	closed := s.order("CLOSED", "1 hour", "{}")
	pay(closed, "20 minutes")
	lost := s.event(s.pools.Payment, closed, 1, "PaymentSucceeded", "20 minutes")

	// The payment that paid the order, and a second one nobody refunded.
	paid := s.order("PAID", "20 minutes", "{}")
	first := pay(paid, "20 minutes")
	s.exec(s.pools.Order, `UPDATE saga_instances SET data = jsonb_build_object('payment_id', $2::text) WHERE id = $1`, paid, first)
	pay(paid, "19 minutes")

	// The order asked for the refund; payment never got RefundRequested.
	asked := s.order("CLOSED", "1 hour", "{}")
	askedPay := pay(asked, "30 minutes")
	s.exec(s.pools.Order, `UPDATE saga_instances SET data = jsonb_build_object('refunded', jsonb_build_array($2::text)) WHERE id = $1`, asked, askedPay)
	refundReq := s.event(s.pools.Order, asked, 2, "RefundRequested", "30 minutes")

	// Refunded, and too recent to judge: no findings.
	refunded := s.order("CLOSED", "1 hour", "{}")
	rp := pay(refunded, "30 minutes")
	s.exec(s.pools.Payment, `INSERT INTO refunds (refund_id, order_id, payment_id, idempotency_key, amount, state)
		VALUES (gen_random_uuid(), $1, $2, gen_random_uuid(), 1000, 'DONE')`, refunded, rp)
	pay(s.order("CLOSED", "10 minutes", "{}"), "1 minute")

	rep := s.run(true)
	if got, want := found(rep, reconcile.UnrefundedPayment), sorted(closed, paid, asked); !slices.Equal(got, want) {
		t.Fatalf("unrefunded payments for %v, want %v", got, want)
	}
	for _, f := range rep.Findings {
		if f.OrderID == asked && !strings.Contains(f.Detail, "requested its refund") {
			t.Errorf("finding %v does not say the refund was requested", f)
		}
	}
	if s.published(s.pools.Payment, lost) {
		t.Error("the lost PaymentSucceeded was not republished")
	}
	if s.published(s.pools.Order, refundReq) {
		t.Error("the lost RefundRequested was not republished")
	}
	if rep.Counts.Republished != 2 {
		t.Errorf("republished %d events, want 2", rep.Counts.Republished)
	}

	// The next run finds the same (the copies are not processed yet) but
	// republishes nothing: the rows wait for the relay.
	if rep := s.run(true); rep.Counts.Republished != 0 || rep.Counts.UnrefundedPayments != 3 {
		t.Errorf("second run: %+v", rep.Counts)
	}
}

func TestHeldReservations(t *testing.T) {
	s := newShop(t)
	s.exec(s.pools.Inventory, `INSERT INTO stock (sku, on_hand, reserved, price, supplied) VALUES ('SKU-1', 10, 3, 100, 10)`)
	reserve := func(order, state string) {
		s.exec(s.pools.Inventory, `INSERT INTO reservations (order_id, sku, quantity, state) VALUES ($1, 'SKU-1', 1, $2)`, order, state)
	}
	closed := s.order("CLOSED", "10 minutes", "{}")
	reserve(closed, "RESERVED")
	completed := s.order("COMPLETED", "2 hours", "{}")
	reserve(completed, "RESERVED")
	open := s.order("WAIT_PAY", "1 minute", "{}")
	reserve(open, "RESERVED")
	justClosed := s.order("CLOSED", "1 minute", "{}")
	reserve(justClosed, "RESERVED")
	reserve(s.order("CLOSED", "1 hour", "{}"), "RELEASED")

	// Inventory processed the closed order's OrderClosed and still holds
	// its stock: nothing was lost, so there is nothing safe to repair. The
	// completed order's OrderPaid never reached inventory.
	closedEv := s.event(s.pools.Order, closed, 1, "OrderClosed", "12 minutes")
	s.reached("ORDERS", closedEv)
	paidEv := s.event(s.pools.Order, completed, 1, "OrderPaid", "3 hours")
	s.reached("ORDERS", paidEv, "inventory-orders")

	rep := s.run(true)
	if got, want := found(rep, reconcile.HeldReservation), sorted(closed, completed); !slices.Equal(got, want) {
		t.Fatalf("held reservations for %v, want %v", got, want)
	}
	if !s.published(s.pools.Order, closedEv) {
		t.Error("OrderClosed, processed by inventory, was republished")
	}
	if s.published(s.pools.Order, paidEv) {
		t.Error("OrderPaid, never processed by inventory, was not republished")
	}
	if rep.Counts.Republished != 1 || rep.Counts.HeldReservations != 2 {
		t.Errorf("counts = %+v", rep.Counts)
	}
	for _, f := range rep.Findings {
		want := map[string]int{closed: 0, completed: 1}[f.OrderID]
		if f.Republished != want {
			t.Errorf("%v: republished %d, want %d", f, f.Republished, want)
		}
	}
}

func TestJobKeepsCounts(t *testing.T) {
	s := newShop(t)
	s.order("PENDING", "1 hour", "{}")
	job := &reconcile.Job{Shop: s.shop}
	if c, runs := job.Last(); c != (reconcile.Counts{}) || runs != 0 {
		t.Fatalf("before a run: %+v, %d", c, runs)
	}
	if _, err := job.Once(context.Background()); err != nil {
		t.Fatal(err)
	}
	c, runs := job.Last()
	if runs != 1 || c.StuckOrders != 1 || c.Of(reconcile.StuckOrder) != 1 {
		t.Fatalf("after a run: %+v, %d", c, runs)
	}
}

// Events that a relay made dead because their stream was missing (an
// empty cluster, before relays waited such a stream out) are put back by
// the repair, with no command typed; dead events of other causes stay for
// an operator, and a run that only reports changes nothing.
func TestRepairRequeuesEventsAMissingStreamKilled(t *testing.T) {
	s := newShop(t)
	ctx := context.Background()
	killed := s.event(s.pools.Payment, uuid.NewString(), 1, "PaymentSucceeded", "1 minute")
	poison := s.event(s.pools.Inventory, uuid.NewString(), 1, "InventoryReserved", "1 minute")
	s.exec(s.pools.Payment, `UPDATE outbox SET published_at = NULL, dead_at = now(), attempts = 1,
		last_error = 'no stream for subject "payment.x.PaymentSucceeded": nats: no response from stream' WHERE event_id = $1`, killed)
	s.exec(s.pools.Inventory, `UPDATE outbox SET published_at = NULL, dead_at = now(), attempts = 1,
		last_error = 'message size exceeds maximum allowed' WHERE event_id = $1`, poison)
	dead := func(pool *pgxpool.Pool, ev uuid.UUID) bool {
		rec, err := outbox.Get(ctx, pool, ev)
		if err != nil {
			t.Fatal(err)
		}
		return rec.DeadAt != nil
	}

	rep, err := reconcile.Run(ctx, s.shop, reconcile.Config{})
	if err != nil || len(rep.Requeued) != 0 || !dead(s.pools.Payment, killed) {
		t.Fatalf("a report-only run requeued %v (%v)", rep.Requeued, err)
	}
	rep, err = reconcile.Run(ctx, s.shop, reconcile.Config{Repair: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Requeued) != 1 || rep.Requeued[0].EventID != killed.String() || rep.Requeued[0].Service != "payment" || rep.Counts.Requeued != 1 {
		t.Fatalf("requeued %+v, want payment's %s", rep.Requeued, killed)
	}
	if dead(s.pools.Payment, killed) || !dead(s.pools.Inventory, poison) {
		t.Fatal("the missing stream's victim is still dead, or the poison was requeued")
	}
	var b strings.Builder
	rep.Write(&b)
	if !strings.Contains(b.String(), "RECONCILE requeued payment event "+killed.String()) {
		t.Errorf("the report does not name the requeued event:\n%s", b.String())
	}
}
