package inventory

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"

	"github.com/shop-ref/shop/pkg/outbox"
)

// batchState is what a batch of order events reads, locked, before it
// decides anything: the stock rows of every SKU it may touch and what is
// recorded about each of its orders. The decisions change it in memory;
// batchWrite remembers what to write.
type batchState struct {
	stock  map[string]*Stock      // locked for the rest of tx, by SKU; unknown SKUs are absent
	orders map[string]*batchOrder // by order id
}

// batchOrder is an order's reservation rows (in SKU order) and tombstone.
type batchOrder struct {
	rows     []*reservationRow
	released bool
}

// reservationRow is one reservation row as the batch leaves it.
type reservationRow struct {
	Item
	state string
	isNew bool   // made by this batch: inserted with its last state
	was   string // its state as read: only a row whose state moved is updated
}

func (st *batchState) order(id string) *batchOrder {
	o := st.orders[id]
	if o == nil {
		o = &batchOrder{}
		st.orders[id] = o
	}
	return o
}

// held is what the order holds in RESERVED state, in SKU order.
func (o *batchOrder) held() []*reservationRow {
	var held []*reservationRow
	for _, r := range o.rows {
		if r.state == "RESERVED" {
			held = append(held, r)
		}
	}
	return held
}

// lockBatchState locks and reads, in one round trip, every stock row the
// batch may touch (the SKUs of its OrderCreated events and of what its
// orders hold), in SKU order, then the reservation rows and tombstones of
// its orders. Stock rows are locked in SKU order by every transaction that
// locks several (a restock locks one), so two batches never wait for each
// other in a cycle. The reservation rows cannot take part in one: the inbox
// recorded every event of the batch before the handler ran, so the batch
// holds the inbox cursor of each of its orders, and any other transaction
// about one of them waits for that cursor before it touches its rows.
func lockBatchState(ctx context.Context, tx pgx.Tx, skus, orders []string) (*batchState, error) {
	st := &batchState{stock: map[string]*Stock{}, orders: map[string]*batchOrder{}}
	b := &pgx.Batch{}
	b.Queue(`
		SELECT `+stockColumns+` FROM stock
		WHERE sku = ANY($1::text[])
		   OR sku IN (SELECT sku FROM reservations WHERE order_id = ANY($2::text[]) AND state = 'RESERVED')
		ORDER BY sku FOR UPDATE`, skus, orders,
	).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			s, err := scanStock(rows)
			if err != nil {
				return err
			}
			st.stock[s.SKU] = &s
		}
		return rows.Err()
	})
	b.Queue(`
		SELECT order_id, sku, quantity, state FROM reservations
		WHERE order_id = ANY($1::text[])
		ORDER BY order_id, sku FOR UPDATE`, orders,
	).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var id string
			r := &reservationRow{}
			if err := rows.Scan(&id, &r.SKU, &r.Quantity, &r.state); err != nil {
				return err
			}
			r.was = r.state
			o := st.order(id)
			o.rows = append(o.rows, r)
		}
		return rows.Err()
	})
	b.Queue(`SELECT order_id FROM released_orders WHERE order_id = ANY($1::text[])`, orders).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				return err
			}
			st.order(id).released = true
		}
		return rows.Err()
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("lock and read the stock and reservations of %d orders: %w", len(orders), err)
	}
	return st, nil
}

// batchWrite is what a batch's decisions write.
type batchWrite struct {
	st         *batchState
	stock      map[string]bool // SKUs whose row changed
	tombstones []string
	events     []batchEvent // in the order decided
}

// batchEvent is an event to emit, with the context of the delivery that
// caused it (its trace).
type batchEvent struct {
	ctx          context.Context
	orderID, typ string
	payload      any
}

func (st *batchState) newWrite() *batchWrite {
	return &batchWrite{st: st, stock: map[string]bool{}}
}

func (w *batchWrite) emit(ctx context.Context, orderID, typ string, payload any) {
	w.events = append(w.events, batchEvent{ctx: ctx, orderID: orderID, typ: typ, payload: payload})
}

// send writes everything in one round trip: the stock rows as the batch
// leaves them (absolute values: the rows are locked since lockBatchState),
// the new reservation rows, the state of the old ones, the tombstones and
// the events. The table's CHECK constraints still stand behind the
// decisions: a stock row can never be written oversold.
func (w *batchWrite) send(ctx context.Context, tx pgx.Tx, s *Service) error {
	b := &pgx.Batch{}
	if len(w.stock) > 0 {
		var skus []string
		var onHand, reserved, sold []int64
		for _, sku := range slices.Sorted(maps.Keys(w.stock)) {
			st := w.st.stock[sku]
			skus = append(skus, sku)
			onHand = append(onHand, st.OnHand)
			reserved = append(reserved, st.Reserved)
			sold = append(sold, st.Sold)
		}
		b.Queue(`
			UPDATE stock SET on_hand = q.on_hand, reserved = q.reserved, sold = q.sold, updated_at = now()
			FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[]) AS q(sku, on_hand, reserved, sold)
			WHERE stock.sku = q.sku`, skus, onHand, reserved, sold)
	}
	var newOrders, newSKUs, newStates, oldOrders, oldSKUs, oldStates []string
	var newQtys []int64
	for _, id := range slices.Sorted(maps.Keys(w.st.orders)) {
		for _, r := range w.st.orders[id].rows {
			switch {
			case r.isNew:
				newOrders, newSKUs, newStates = append(newOrders, id), append(newSKUs, r.SKU), append(newStates, r.state)
				newQtys = append(newQtys, r.Quantity)
			case r.state != r.was:
				oldOrders, oldSKUs, oldStates = append(oldOrders, id), append(oldSKUs, r.SKU), append(oldStates, r.state)
			}
		}
	}
	if len(newOrders) > 0 {
		b.Queue(`
			INSERT INTO reservations (order_id, sku, quantity, state)
			SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[])`,
			newOrders, newSKUs, newQtys, newStates)
	}
	if len(oldOrders) > 0 {
		b.Queue(`
			UPDATE reservations SET state = q.state, updated_at = now()
			FROM unnest($1::text[], $2::text[], $3::text[]) AS q(order_id, sku, state)
			WHERE reservations.order_id = q.order_id AND reservations.sku = q.sku`,
			oldOrders, oldSKUs, oldStates)
	}
	if len(w.tombstones) > 0 {
		b.Queue(`
			INSERT INTO released_orders (order_id) SELECT unnest($1::text[])
			ON CONFLICT (order_id) DO NOTHING`, w.tombstones)
	}
	// The events in one call, so in one statement (a statement each was
	// half of the batch's write), each with the trace of the delivery that
	// caused it in its own headers (the writer keeps a traceparent it is
	// given) rather than one trace for all.
	events := make([]outbox.Event, len(w.events))
	for i, e := range w.events {
		events[i] = orderEventOf(e.orderID, e.typ, e.payload)
		trace := propagation.MapCarrier{}
		propagation.TraceContext{}.Inject(e.ctx, trace)
		events[i].Headers = trace
	}
	if err := s.outbox.Queue(ctx, b, events...); err != nil {
		return err
	}
	if b.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("write the decisions of a batch: %w", err)
	}
	return nil
}
