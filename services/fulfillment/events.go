package fulfillment

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Event types this service consumes and emits (docs/events.md).
const (
	typeOrderPaid          = "OrderPaid"
	typeFulfillmentStarted = "FulfillmentStarted"
	typeShipmentDelivered  = "ShipmentDelivered"
)

// Item is one order line as OrderPaid carries it and FulfillmentStarted
// repeats it.
type Item struct {
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

// orderPaid is the part of OrderPaid this service reads; unknown fields are
// ignored (tolerant reader).
type orderPaid struct {
	OrderID string `json:"order_id"`
	Items   []Item `json:"items"`
}

// FulfillmentStarted is the payload of the FulfillmentStarted event.
type FulfillmentStarted struct {
	OrderID    uuid.UUID `json:"order_id"`
	ShipmentID uuid.UUID `json:"shipment_id"`
	Items      []Item    `json:"items"`
}

// ShipmentDelivered is the payload of the ShipmentDelivered event.
type ShipmentDelivered struct {
	OrderID     uuid.UUID `json:"order_id"`
	ShipmentID  uuid.UUID `json:"shipment_id"`
	DeliveredAt time.Time `json:"delivered_at"`
}

// handle is the fulfillment-orders inbox handler. It runs in the inbox
// transaction, so the shipment, its FulfillmentStarted event and the record
// that this OrderPaid was processed commit together or not at all.
func (s *Service) handle(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	if m.Type != typeOrderPaid {
		return nil // unreachable while the stream filter delivers only OrderPaid; recorded and ignored if it changes
	}
	if m.SchemaVersion != 1 {
		// A version this code does not know will not parse better on the
		// next delivery: dead-letter it at once for an operator.
		return inbox.Poison(fmt.Errorf("%s schema version %d is not supported", m.Type, m.SchemaVersion))
	}
	ev, err := decodeOrderPaid(m)
	if err != nil {
		return inbox.Poison(err)
	}
	if _, err := s.startShipment(ctx, tx, ev); err != nil {
		return fmt.Errorf("start shipment for order %s: %w", ev.orderID, err)
	}
	return nil
}

// paid is a validated OrderPaid.
type paid struct {
	orderID uuid.UUID
	items   []Item
}

func decodeOrderPaid(m inbox.Message) (paid, error) {
	var ev orderPaid
	if err := json.Unmarshal(m.Data, &ev); err != nil {
		return paid{}, fmt.Errorf("decode %s: %w", m.Type, err)
	}
	id, err := uuid.Parse(ev.OrderID)
	if err != nil {
		return paid{}, fmt.Errorf("%s order_id %q: %w", m.Type, ev.OrderID, err)
	}
	// The subject and cursor are keyed by Aggregate-Id; a payload about
	// another order would be applied under the wrong aggregate's sequence.
	if m.AggregateID != ev.OrderID {
		return paid{}, fmt.Errorf("%s order_id %s does not match Aggregate-Id %s", m.Type, ev.OrderID, m.AggregateID)
	}
	if len(ev.Items) == 0 {
		return paid{}, errors.New(m.Type + " has no items")
	}
	return paid{orderID: id, items: ev.Items}, nil
}

// startedEvent is the outbox event of a new shipment.
func startedEvent(sh Shipment) outbox.Event {
	return orderEvent(sh.OrderID, typeFulfillmentStarted, sh.StartedAt, FulfillmentStarted{
		OrderID:    sh.OrderID,
		ShipmentID: sh.ShipmentID,
		Items:      sh.Items,
	})
}

// deliveredEvent is the outbox event of a delivered shipment.
func deliveredEvent(orderID, shipmentID uuid.UUID, at time.Time) outbox.Event {
	return orderEvent(orderID, typeShipmentDelivered, at, ShipmentDelivered{
		OrderID:     orderID,
		ShipmentID:  shipmentID,
		DeliveredAt: at,
	})
}

// orderEvent builds an event of the order aggregate; the service's writer
// publishes it on the contract's subject fulfillment.<order_id>.<Type>. Seq is left to the outbox counter, which numbers this service's
// events per order 1, 2 … without gaps.
func orderEvent(orderID uuid.UUID, typ string, at time.Time, payload any) outbox.Event {
	id := orderID.String()
	return outbox.Event{
		AggregateType: "order",
		AggregateID:   id,
		Type:          typ,
		SchemaVersion: 1,
		Payload:       payload,
		OccurredAt:    at,
	}
}
