package order

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/saga"
)

// event is an outbox event of an order: aggregate "order", published on
// orders.<id>.<type> by the service's writer (its Prefix). Its sequence
// comes from the outbox's counter.
func event(id uuid.UUID, typ string, payload any) outbox.Event {
	return outbox.Event{
		AggregateType: "order",
		AggregateID:   id.String(),
		Type:          typ,
		Payload:       payload,
	}
}

// The upstream events the saga acts on. Each consumer's inbox
// Config.Handles lists them too, so the others (inventory's released and
// committed notices) only advance the sequence cursor.
var (
	inventoryOutcomes   = []string{"InventoryReserved", "InventoryRejected"}
	paymentOutcomes     = []string{"PaymentOpened", "PaymentSucceeded", "PaymentFailed", "PaymentExpired", "PaymentRefunded"}
	fulfillmentOutcomes = []string{"FulfillmentStarted", "ShipmentDelivered"}
)

// handler is the inbox Config.Handler of a saga consumer, whose saga
// events are outcomes. The saga events of a batch go to Saga.ApplyBatch
// together (the order saga's funcs read only their own order, as
// ApplyBatch requires): two round trips a batch, where one event at a time
// takes two an event. A ProductUpdated (order-inventory's catalogue feed)
// runs in its place in the stream, after the saga events before it are
// saved, so the batch's order holds. Other types are only recorded by the
// inbox (Config.Handles) and never reach it.
func (s *Service) handler(outcomes []string) inbox.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, batch []inbox.Batched) error {
		var (
			events []saga.BatchEvent
			msgs   []inbox.Message
		)
		flush := func() error {
			if len(events) == 0 {
				return nil
			}
			results, err := s.saga.ApplyBatch(ctx, tx, events)
			if err != nil {
				return err
			}
			for i, res := range results {
				s.logTransition(msgs[i], res)
			}
			events, msgs = nil, nil
			return nil
		}
		for _, b := range batch {
			if err := checkVersion(b.Message); err != nil {
				return err
			}
			switch {
			case slices.Contains(outcomes, b.Type):
				events = append(events, saga.BatchEvent{Ctx: b.Ctx, ID: b.AggregateID, Event: sagaEvent(b.Message)})
				msgs = append(msgs, b.Message)
			case b.Type == "ProductUpdated":
				if err := flush(); err != nil {
					return err
				}
				if err := updateProduct(b.Ctx, tx, b.Message); err != nil {
					return err
				}
			}
		}
		return flush()
	}
}

// updateProduct applies a ProductUpdated to the catalogue order reads its
// prices from.
func updateProduct(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	var p struct {
		SKU   string `json:"sku"`
		Price *int64 `json:"price"`
	}
	if err := json.Unmarshal(m.Data, &p); err != nil || p.SKU == "" || p.Price == nil || *p.Price < 0 {
		return inbox.Poison(fmt.Errorf("ProductUpdated payload %s: %v", m.Data, err))
	}
	return upsertProduct(ctx, tx, p.SKU, *p.Price, m.Seq)
}

func sagaEvent(m inbox.Message) saga.Event {
	return saga.Event{Type: m.Type, ID: m.EventID.String(), Data: m.Data}
}

func (s *Service) logTransition(m inbox.Message, res saga.Result) {
	if !res.Applied {
		s.log.Warn("saga event unexpected", "order_id", m.AggregateID, "event", m.Type, "event_id", m.EventID, "state", res.From)
	} else {
		s.log.Info("saga transition", "order_id", m.AggregateID, "event", m.Type, "from", res.From, "to", res.To)
	}
}

// checkVersion refuses payload versions this code does not know: retrying
// cannot help, so the event is dead-lettered until the code is upgraded.
func checkVersion(m inbox.Message) error {
	if m.SchemaVersion != 1 {
		return inbox.Poison(fmt.Errorf("%s schema version %d: only 1 is known", m.Type, m.SchemaVersion))
	}
	return nil
}
