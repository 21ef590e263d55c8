package inventory

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Event types, as docs/events.md names them.
const (
	// Read from ORDERS.
	TypeOrderCreated  = "OrderCreated"
	TypeOrderRejected = "OrderRejected"
	TypeOrderClosed   = "OrderClosed"
	TypeOrderPaid     = "OrderPaid"

	// Emitted to INVENTORY.
	TypeProductUpdated     = "ProductUpdated"
	TypeInventoryReserved  = "InventoryReserved"
	TypeInventoryRejected  = "InventoryRejected"
	TypeInventoryReleased  = "InventoryReleased"
	TypeInventoryCommitted = "InventoryCommitted"
)

// Reasons of InventoryRejected.
const (
	ReasonInsufficientStock = "insufficient_stock" // some line cannot be reserved
	ReasonReleased          = "released"           // the order was released before it was reserved
)

// Item is one order line: a SKU and a number of units.
type Item struct {
	SKU      string `json:"sku"`
	Quantity int64  `json:"quantity"`
}

// ProductUpdated is emitted by PUT /stock/{sku}; aggregate "product" = SKU.
type ProductUpdated struct {
	SKU       string `json:"sku"`
	Price     int64  `json:"price"`
	OnHand    int64  `json:"on_hand"`
	Reserved  int64  `json:"reserved"`
	Available int64  `json:"available"`
}

// InventoryItems is the payload of InventoryReserved, InventoryReleased and
// InventoryCommitted: the lines concerned, one per SKU.
type InventoryItems struct {
	OrderID string `json:"order_id"`
	Items   []Item `json:"items"`
}

// InventoryRejected says an order could not be reserved; nothing is held.
// SKU is the first line that was short (empty for ReasonReleased).
type InventoryRejected struct {
	OrderID string `json:"order_id"`
	Reason  string `json:"reason"`
	SKU     string `json:"sku"`
}

// orderEvent is what this service reads of the order events it handles:
// OrderCreated carries items; OrderClosed, OrderRejected and OrderPaid need
// only the order id, because the reservation rows, not the event, say what
// is held. Unknown fields are ignored (a tolerant reader).
type orderEvent struct {
	OrderID string `json:"order_id"`
	Items   []Item `json:"items"`
	// Currency is OrderCreated's from version 2 on (ISO 4217, the unit of
	// its prices and total; DefaultCurrency when absent); version 1 is
	// always in DefaultCurrency.
	// Inventory holds units, not money: it checks the field and logs it.
	Currency string `json:"currency"`
}

// DefaultCurrency is the currency of an OrderCreated of version 1, which has
// no currency field.
const DefaultCurrency = "EUR"

// readVersions is the newest schema version this service reads of each
// event type it handles: OrderCreated 1 and 2, the others 1 only. Older
// versions stay readable for good (events published before a bump may be
// replayed weeks later); a newer one needs newer code, so it is a dead
// letter until an upgrade requeues it.
var readVersions = map[string]int{
	TypeOrderCreated:  2,
	TypeOrderRejected: 1,
	TypeOrderClosed:   1,
	TypeOrderPaid:     1,
}

// decodeOrderEvent reads m's payload by its schema version.
func decodeOrderEvent(m inbox.Message) (orderEvent, error) {
	var ev orderEvent
	if newest := readVersions[m.Type]; m.SchemaVersion < 1 || m.SchemaVersion > newest {
		// Retrying this binary cannot help: poison, not a retry.
		return ev, inbox.Poison(fmt.Errorf("%s schema version %d: this service reads versions 1 to %d", m.Type, m.SchemaVersion, newest))
	}
	if err := json.Unmarshal(m.Data, &ev); err != nil {
		return ev, inbox.Poison(fmt.Errorf("decode %s v%d: %w", m.Type, m.SchemaVersion, err))
	}
	if m.Type != TypeOrderCreated {
		return ev, nil
	}
	switch m.SchemaVersion {
	case 1:
		ev.Currency = DefaultCurrency // v1 predates the field; anything sent in it is not v1's
	case 2:
		// The field is optional even in v2 (EUR when absent): inventory does
		// not need it, so only a value that cannot be a currency, a sign of
		// a broken producer, stops the event.
		if ev.Currency == "" {
			ev.Currency = DefaultCurrency
		} else if !validCurrency(ev.Currency) {
			return ev, inbox.Poison(fmt.Errorf("%s v2: currency %q is not an ISO 4217 code", m.Type, ev.Currency))
		}
	}
	return ev, nil
}

// validCurrency reports whether c looks like an ISO 4217 code: three
// capital letters.
func validCurrency(c string) bool {
	if len(c) != 3 {
		return false
	}
	for _, r := range []byte(c) {
		if r < 'A' || r > 'Z' {
			return false
		}
	}
	return true
}

// handledTypes are the ORDERS events inventory acts on (inbox
// Config.Handles); the others only advance the aggregate's cursor.
var handledTypes = []string{TypeOrderCreated, TypeOrderClosed, TypeOrderRejected, TypeOrderPaid}

// readOrderEvent reads and checks an order event of a handled type; the
// items of an OrderCreated come back merged (mergeLines). What breaks the
// contract is poison.
func readOrderEvent(m inbox.Message) (orderEvent, error) {
	ev, err := decodeOrderEvent(m)
	if err != nil {
		return ev, err
	}
	if err := validOrderID(ev.OrderID, m.AggregateID); err != nil {
		return ev, inbox.Poison(fmt.Errorf("%s: %w", m.Type, err))
	}
	if m.Type != TypeOrderCreated {
		ev.Items = nil // commit and release read what is held, not the event
		return ev, nil
	}
	if ev.Items, err = mergeLines(ev.Items); err != nil {
		return ev, inbox.Poison(fmt.Errorf("%s %s: %w", m.Type, ev.OrderID, err))
	}
	return ev, nil
}

// orderEventOf builds an event of the order aggregate; the service's writer
// publishes it on the contract's subject inventory.<order_id>.<Type>.
func orderEventOf(orderID, typ string, payload any) outbox.Event {
	return outbox.Event{
		AggregateType: "order",
		AggregateID:   orderID,
		Type:          typ,
		SchemaVersion: 1,
		Payload:       payload,
	}
}

// productEvent is the ProductUpdated event of a stock row, aggregate
// "product" with the SKU as its id: inventory.<sku>.ProductUpdated.
func productEvent(st Stock) outbox.Event {
	return outbox.Event{
		AggregateType: "product",
		AggregateID:   st.SKU,
		Type:          TypeProductUpdated,
		SchemaVersion: 1,
		Payload: ProductUpdated{
			SKU: st.SKU, Price: st.Price, OnHand: st.OnHand, Reserved: st.Reserved, Available: st.Available,
		},
	}
}

// validOrderID checks the payload's order id against the message's
// aggregate id, and that it can be a subject token: an id with '.', '*', '>'
// or whitespace would make the events we emit about it unpublishable.
func validOrderID(id, aggregateID string) error {
	switch {
	case id == "":
		return errors.New("no order_id")
	case id != aggregateID:
		return fmt.Errorf("order_id %q differs from Aggregate-Id %q", id, aggregateID)
	case strings.ContainsAny(id, ".*> \t\r\n"):
		return fmt.Errorf("order_id %q cannot be a subject token", id)
	}
	return nil
}

// mergeLines checks an order's lines and merges lines of one SKU, keeping
// the order of first appearance: the lines become one reservation row per
// SKU, and the first short line is the one a rejection names.
func mergeLines(lines []Item) ([]Item, error) {
	if len(lines) == 0 {
		return nil, errors.New("no items")
	}
	var items []Item
	at := map[string]int{}
	for i, l := range lines {
		if !httpx.ValidSKU(l.SKU) {
			return nil, fmt.Errorf("item %d: invalid sku %q", i, l.SKU)
		}
		// The order service allows 1…1000; the upper bound here only keeps
		// merged sums far from overflow whatever a producer sends.
		if l.Quantity < 1 || l.Quantity > maxAmount {
			return nil, fmt.Errorf("item %d (%s): quantity %d", i, l.SKU, l.Quantity)
		}
		if j, ok := at[l.SKU]; ok {
			items[j].Quantity += l.Quantity // at most len(lines) * maxAmount
			continue
		}
		at[l.SKU] = len(items)
		items = append(items, l)
	}
	return items, nil
}
