package inventory

import (
	"cmp"
	"context"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
)

// A batch of order events, decided together. One at a time, each
// reservation costs two round trips (read and lock, then write) while it
// holds the stock rows of its SKUs, which under load are the same few hot
// SKUs for every order: batches of other workers wait for those rows, so
// the round trips of every batch add up, one batch after another. Here a
// batch costs two round trips whatever its size: one locks and reads every
// row the batch needs, the decisions are made in memory in stream order,
// exactly as handle would make them one event after another, and one
// writes the outcome (stock, reservations, tombstones and the events, each
// with its own trace).

// handleBatch is the consumer's inbox Config.BatchHandler. It leaves what
// handle, called on each event of batch in turn, would leave:
// TestBatchDecidesAsOneAtATime holds it to that on random histories. An
// event that breaks the contract fails the whole batch, which the inbox
// then hands to handle one event at a time, so only that one is poisoned.
func (s *Service) handleBatch(ctx context.Context, tx pgx.Tx, batch []inbox.Batched) error {
	evs := make([]orderEvent, len(batch))
	var skus, orders []string
	for i, b := range batch {
		ev, err := readOrderEvent(b.Message)
		if err != nil {
			return err
		}
		evs[i] = ev
		orders = append(orders, ev.OrderID)
		for _, it := range ev.Items {
			skus = append(skus, it.SKU)
		}
	}
	st, err := lockBatchState(ctx, tx, skus, orders)
	if err != nil {
		return err
	}
	w := st.newWrite()
	for i, b := range batch {
		switch ev := evs[i]; b.Type {
		case TypeOrderCreated:
			s.log.Debug("order created", "order_id", ev.OrderID, "schema_version", b.SchemaVersion, "currency", ev.Currency)
			s.reserveIn(b.Ctx, st, w, ev)
		case TypeOrderPaid:
			s.commitIn(b.Ctx, st, w, ev.OrderID)
		default:
			s.releaseIn(b.Ctx, st, w, ev.OrderID)
		}
	}
	return w.send(ctx, tx, s)
}

// reserveIn decides an OrderCreated as reserve would.
func (s *Service) reserveIn(ctx context.Context, st *batchState, w *batchWrite, ev orderEvent) {
	o := st.order(ev.OrderID)
	switch {
	case len(o.rows) > 0:
		s.log.Debug("order already reserved", "order_id", ev.OrderID)
		return
	case o.released:
		s.log.Debug("inventory rejected", "order_id", ev.OrderID, "reason", ReasonReleased)
		w.emit(ctx, ev.OrderID, TypeInventoryRejected, InventoryRejected{OrderID: ev.OrderID, Reason: ReasonReleased})
		return
	}
	for _, it := range ev.Items {
		if stock, ok := st.stock[it.SKU]; !ok || stock.Available < it.Quantity {
			s.log.Debug("inventory rejected", "order_id", ev.OrderID, "reason", ReasonInsufficientStock, "sku", it.SKU)
			w.emit(ctx, ev.OrderID, TypeInventoryRejected,
				InventoryRejected{OrderID: ev.OrderID, Reason: ReasonInsufficientStock, SKU: it.SKU})
			return
		}
	}
	for _, it := range ev.Items {
		stock := st.stock[it.SKU]
		stock.Reserved += it.Quantity
		stock.Available -= it.Quantity
		w.stock[it.SKU] = true
		o.rows = append(o.rows, &reservationRow{Item: it, state: "RESERVED", isNew: true})
	}
	slices.SortFunc(o.rows, func(a, b *reservationRow) int { return cmp.Compare(a.SKU, b.SKU) })
	s.log.Debug("inventory reserved", "order_id", ev.OrderID, "lines", len(ev.Items))
	w.emit(ctx, ev.OrderID, TypeInventoryReserved, InventoryItems{OrderID: ev.OrderID, Items: ev.Items})
}

// commitIn decides an OrderPaid as commit would.
func (s *Service) commitIn(ctx context.Context, st *batchState, w *batchWrite, orderID string) {
	held := st.order(orderID).held()
	if len(held) == 0 {
		s.log.Debug("nothing to commit", "order_id", orderID)
		return
	}
	items := make([]Item, len(held))
	for i, r := range held {
		stock := st.stock[r.SKU]
		stock.OnHand -= r.Quantity
		stock.Reserved -= r.Quantity
		stock.Sold += r.Quantity
		w.stock[r.SKU] = true
		r.state = "COMMITTED"
		items[i] = r.Item
	}
	s.log.Debug("inventory committed", "order_id", orderID, "lines", len(items))
	w.emit(ctx, orderID, TypeInventoryCommitted, InventoryItems{OrderID: orderID, Items: items})
}

// releaseIn decides an OrderClosed or OrderRejected as release would.
func (s *Service) releaseIn(ctx context.Context, st *batchState, w *batchWrite, orderID string) {
	o := st.order(orderID)
	held := o.held()
	if len(held) == 0 {
		if !o.released {
			o.released = true
			w.tombstones = append(w.tombstones, orderID)
		}
		return
	}
	items := make([]Item, len(held))
	for i, r := range held {
		stock := st.stock[r.SKU]
		stock.Reserved -= r.Quantity
		stock.Available += r.Quantity
		w.stock[r.SKU] = true
		r.state = "RELEASED"
		items[i] = r.Item
	}
	s.log.Debug("inventory released", "order_id", orderID, "lines", len(items))
	w.emit(ctx, orderID, TypeInventoryReleased, InventoryItems{OrderID: orderID, Items: items})
}
