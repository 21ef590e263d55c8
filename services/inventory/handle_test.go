package inventory

import (
	"context"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/proof/streamtest"
)

// history is a random stream of order events over a few scarce SKUs: each
// order follows one of the scripts below (its events in sequence), and the
// orders' events are interleaved at random, as the ORDERS stream would
// interleave them.
func history(t *testing.T, rng *rand.Rand, orders int) []inbox.Message {
	t.Helper()
	skus := []string{"A", "B", "C", "D"}
	line := func() Item {
		if rng.IntN(20) == 0 {
			return Item{"GHOST", 1} // not stocked: rejected
		}
		return Item{skus[rng.IntN(len(skus))], int64(1 + rng.IntN(4))}
	}
	scripts := [][]string{
		{TypeOrderCreated, TypeOrderPaid},
		{TypeOrderCreated, TypeOrderPaid},
		{TypeOrderCreated, TypeOrderClosed},
		{TypeOrderCreated, TypeOrderRejected},
		{TypeOrderClosed, TypeOrderCreated},                   // released before reserved: a tombstone
		{TypeOrderCreated, TypeOrderCreated, TypeOrderClosed}, // a second OrderCreated under another id
		{TypeOrderCreated},
		{TypeOrderPaid, TypeOrderCreated},
		{TypeOrderCreated, TypeOrderPaid, TypeOrderClosed},
		{TypeOrderRejected, TypeOrderClosed},
	}
	var queues [][]inbox.Message
	for i := range orders {
		id := fmt.Sprintf("order-%03d", i)
		var items []Item
		for range 1 + rng.IntN(3) {
			items = append(items, line()) // a SKU may come twice: merged
		}
		var q []inbox.Message
		for seq, typ := range scripts[rng.IntN(len(scripts))] {
			payload := orderClosed(id, "payment_timeout")
			switch typ {
			case TypeOrderCreated:
				payload = orderCreated(id, items...)
			case TypeOrderPaid:
				payload = orderPaid(id)
			}
			q = append(q, message(t, id, int64(seq+1), typ, payload))
		}
		queues = append(queues, q)
	}
	return streamtest.Interleave(rng, queues)
}

// The size of a batch changes nothing the handler decides: a batch carries
// its earlier decisions to its later events in memory (stock taken, orders
// reserved or released), and that must match what the database tells a
// batch of one. The same random histories, applied one event per
// transaction on one schema and in batches of random sizes on another,
// leave the same stock, reservations, tombstones and events, payloads
// included.
func TestBatchSizeChangesNoDecision(t *testing.T) {
	t.Parallel()
	streamtest.Seeds(t, 6, func(t *testing.T, rng *rand.Rand) {
		stream := history(t, rng, 60)
		alone, batched := setup(t), setup(t)
		for _, f := range []*fixture{alone, batched} {
			for _, sku := range []string{"A", "B", "C", "D"} {
				f.seed(t, sku, 15, 100)
			}
		}
		for _, m := range stream {
			if err := alone.apply(t, m); err != nil {
				t.Fatalf("%s %s: %v", m.Type, m.AggregateID, err)
			}
		}
		for _, batch := range streamtest.Batches(t, rng, stream, 24) {
			if err := batched.applyBatch(t, batch); err != nil {
				t.Fatalf("a batch of %d: %v", len(batch), err)
			}
		}
		a, b := alone.snapshot(t), batched.snapshot(t)
		if a != b {
			t.Errorf("one at a time and in batches differ:\n--- one at a time\n%s\n--- in batches\n%s", a, b)
		}
		// Each event carries the trace of the delivery that caused it,
		// not a neighbour's in the batch.
		rows, err := batched.pool.Query(context.Background(),
			`SELECT aggregate_id, headers->>'traceparent' FROM outbox WHERE aggregate_type = 'order'`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var id, parent string
			if err := rows.Scan(&id, &parent); err != nil {
				t.Fatal(err)
			}
			if want := orderSpan(id).TraceID().String(); !strings.Contains(parent, want) {
				t.Errorf("an event of %s has traceparent %q, want trace %s", id, parent, want)
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		// The histories reach every decision, or the comparison is thin.
		for _, want := range []string{TypeInventoryReserved, TypeInventoryCommitted, TypeInventoryReleased,
			ReasonInsufficientStock, ReasonReleased, "tombstone"} {
			if !strings.Contains(a, want) {
				t.Errorf("the history never reached %s", want)
			}
		}
	})
}

// applyBatch calls the consumer's handler directly in a transaction
// of its own, as the inbox would, and commits.
func (f *fixture) applyBatch(t *testing.T, ms []inbox.Message) error {
	t.Helper()
	ctx := context.Background()
	tx, err := f.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	batch := make([]inbox.Batched, len(ms))
	for i, m := range ms {
		batch[i] = inbox.Batched{Message: m, Ctx: trace.ContextWithSpanContext(ctx, orderSpan(m.AggregateID))}
	}
	if err := f.svc.handle(ctx, tx, batch); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// orderSpan is the span context applyBatch gives every event of orderID,
// as if each order were a trace of its own.
func orderSpan(orderID string) trace.SpanContext {
	sum := sha256.Sum256([]byte(orderID))
	return trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID(sum[:16]), SpanID: trace.SpanID(sum[16:24]), TraceFlags: trace.FlagsSampled,
	})
}

// snapshot is the service's state as text: stock, reservations,
// tombstones, and the order events it emitted, in sequence.
func (f *fixture) snapshot(t *testing.T) string {
	t.Helper()
	return f.db.Dump(t,
		`SELECT sku, on_hand, reserved, sold, supplied FROM stock ORDER BY sku`,
		`SELECT order_id, sku, quantity, state FROM reservations ORDER BY order_id, sku`,
		`SELECT 'tombstone', order_id FROM released_orders ORDER BY order_id`,
		`SELECT aggregate_id, aggregate_seq, event_type, payload::jsonb FROM outbox
		 WHERE aggregate_type = 'order' ORDER BY aggregate_id, aggregate_seq`)
}

// Batches of other workers racing for the last units of two SKUs sell no
// more than there is: each batch decides under the locks it took for all
// its orders, so what it reads is what the batches before it left. Every
// order gets exactly one answer, and what the reservations hold is what
// the stock rows say is reserved.
func TestConcurrentBatchesDoNotOversell(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "A", 40, 100)
	f.seed(t, "B", 25, 100)
	const workers, batches, perBatch = 6, 5, 6
	work := make([][][]inbox.Message, workers) // built here: message may fail the test, which only this goroutine may do
	rng := rand.New(rand.NewPCG(7, 7))
	for w := range work {
		for b := range batches {
			var ms []inbox.Message
			for o := range perBatch {
				id := fmt.Sprintf("order-%d-%d-%d", w, b, o)
				items := []Item{{"A", int64(1 + rng.IntN(3))}}
				if rng.IntN(2) == 0 {
					items = append(items, Item{"B", int64(1 + rng.IntN(2))})
				}
				ms = append(ms, message(t, id, 1, TypeOrderCreated, orderCreated(id, items...)))
			}
			work[w] = append(work[w], ms)
		}
	}
	var wg sync.WaitGroup
	for w, mine := range work {
		wg.Go(func() {
			for b, ms := range mine {
				if err := f.applyBatch(t, ms); err != nil {
					t.Errorf("worker %d batch %d: %v", w, b, err)
				}
			}
		})
	}
	wg.Wait()
	for _, sku := range []string{"A", "B"} {
		st := f.stock(t, sku)
		held := f.count(t, `SELECT coalesce(sum(quantity), 0) FROM reservations WHERE sku = $1 AND state = 'RESERVED'`, sku)
		if st.Reserved != int64(held) || st.Reserved > st.OnHand {
			t.Errorf("stock %s %+v, but the reservations hold %d", sku, st, held)
		}
	}
	if n := f.count(t, `SELECT count(*) FROM outbox WHERE aggregate_type = 'order'`); n != workers*batches*perBatch {
		t.Errorf("%d answers for %d orders", n, workers*batches*perBatch)
	}
	if n := f.count(t, `SELECT count(*) FROM outbox o WHERE event_type = 'InventoryReserved'
		AND NOT EXISTS (SELECT 1 FROM reservations r WHERE r.order_id = o.aggregate_id)`); n != 0 {
		t.Errorf("%d orders answered reserved hold nothing", n)
	}
	if n := f.count(t, `SELECT count(*) FROM outbox WHERE event_type = 'InventoryRejected'`); n == 0 {
		t.Error("no order was short of stock; the race for the last units never happened")
	}
}
