package inventory

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
)

// The consumer's handler decides a batch of order events together (a lone
// delivery is a batch of one). Each reservation holds the stock rows of its
// SKUs, which under load are the same few hot SKUs for every order:
// batches of other workers wait for those rows, so the round trips of
// every batch add up, one batch after another. A batch therefore costs two
// round trips whatever its size: one locks and reads every row the batch
// needs, the decisions are made in memory in stream order, one event after
// another, and one writes the outcome (stock, reservations, tombstones and
// the events, each with its own trace).

// handle is the consumer's inbox Config.Handler. An event that breaks the
// contract fails the whole batch, which the inbox then hands back one
// event at a time, so only that one is poisoned.
func (s *Service) handle(ctx context.Context, tx pgx.Tx, batch []inbox.Batched) error {
	// Only handled types reach it through the consumer (Config.Handles);
	// any other passes, untouched.
	batch = slices.DeleteFunc(slices.Clone(batch), func(b inbox.Batched) bool { return !slices.Contains(handledTypes, b.Type) })
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
		if err := s.apply(b.Ctx, st, w, b.Type, evs[i]); err != nil {
			return err
		}
	}
	return w.send(ctx, tx, s)
}

// apply decides one event of a batch. Every type of handledTypes has its
// own case: a type declared there without one is an error, never a quiet
// release of the order's stock (TestEveryHandledTypeHasACase).
func (s *Service) apply(ctx context.Context, st *batchState, w *batchWrite, typ string, ev orderEvent) error {
	switch typ {
	case TypeOrderCreated:
		s.reserve(ctx, st, w, ev)
	case TypeOrderPaid:
		s.commit(ctx, st, w, ev.OrderID)
	case TypeOrderClosed, TypeOrderRejected:
		s.release(ctx, st, w, ev.OrderID)
	default:
		return fmt.Errorf("services/inventory/handle.go: apply has no case for %s, which handledTypes declares", typ)
	}
	return nil
}

// reserve holds every line of an order or none of them. An order reserved
// before (the inbox stops copies of one event; this stops a second
// OrderCreated under another id) changes nothing: the answer was sent then.
// An order released before its OrderCreated came (a tombstone) is rejected:
// holding stock now would hold it for ever. Availability is decided under
// the stock rows' locks, so two orders for the last unit cannot both see it
// free.
func (s *Service) reserve(ctx context.Context, st *batchState, w *batchWrite, ev orderEvent) {
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

// commit turns what a paid order holds into sold units: they leave on_hand
// and reserved and join sold, so on_hand + sold stays equal to supplied.
// With nothing held (already committed, or released because payment came
// after the close, in which case the saga refunds) it does nothing.
func (s *Service) commit(ctx context.Context, st *batchState, w *batchWrite, orderID string) {
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

// release gives back what an order holds, for an OrderClosed or an
// OrderRejected. With nothing held it leaves a tombstone instead, because
// the order's OrderCreated may still be on its way (or its reservation
// dead-lettered and requeued later) and must not hold stock for an order
// that has ended.
func (s *Service) release(ctx context.Context, st *batchState, w *batchWrite, orderID string) {
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
