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
	paymentOutcomes     = []string{"PaymentOpened", "PaymentSucceeded", "PaymentFailed", "PaymentRefunded"}
	fulfillmentOutcomes = []string{"FulfillmentStarted", "ShipmentDelivered"}
)

// handleInventory is the order-inventory consumer: catalogue updates and
// reservation outcomes.
func (s *Service) handleInventory(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	switch m.Type {
	case "ProductUpdated":
		if err := checkVersion(m); err != nil {
			return err
		}
		var p struct {
			SKU   string `json:"sku"`
			Price *int64 `json:"price"`
		}
		if err := json.Unmarshal(m.Data, &p); err != nil || p.SKU == "" || p.Price == nil || *p.Price < 0 {
			return inbox.Poison(fmt.Errorf("ProductUpdated payload %s: %v", m.Data, err))
		}
		return upsertProduct(ctx, tx, p.SKU, *p.Price, m.Seq)
	}
	if slices.Contains(inventoryOutcomes, m.Type) {
		return s.applyEvent(ctx, tx, m)
	}
	return nil
}

// handlePayment is the order-payment consumer.
func (s *Service) handlePayment(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	if slices.Contains(paymentOutcomes, m.Type) {
		return s.applyEvent(ctx, tx, m)
	}
	return nil
}

// handleFulfillment is the order-fulfillment consumer.
func (s *Service) handleFulfillment(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	if slices.Contains(fulfillmentOutcomes, m.Type) {
		return s.applyEvent(ctx, tx, m)
	}
	return nil
}

// applyEvent hands an order event to the saga in the inbox transaction, so
// the transition, its outbox events and the processed_events row commit
// together. An event the saga does not expect is recorded and acked.
func (s *Service) applyEvent(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	if err := checkVersion(m); err != nil {
		return err
	}
	res, err := s.saga.Apply(ctx, tx, m.AggregateID, sagaEvent(m))
	if err != nil {
		return err
	}
	s.logTransition(m, res)
	return nil
}

// batchHandler is a saga consumer's inbox Config.BatchHandler: the saga
// events of a batch go to Saga.ApplyBatch together (the order saga's funcs
// read only their own order, as ApplyBatch requires), two round trips
// where one at a time takes two an event. Any other event handle applies
// (ProductUpdated) runs in its place in the stream, after the saga events
// before it are saved, so the batch's order holds.
func (s *Service) batchHandler(outcomes []string, handle inbox.HandlerFunc) inbox.BatchHandlerFunc {
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
			if !slices.Contains(outcomes, b.Type) {
				if err := flush(); err != nil {
					return err
				}
				if err := handle(b.Ctx, tx, b.Message); err != nil {
					return err
				}
				continue
			}
			if err := checkVersion(b.Message); err != nil {
				return err
			}
			events = append(events, saga.BatchEvent{Ctx: b.Ctx, ID: b.AggregateID, Event: sagaEvent(b.Message)})
			msgs = append(msgs, b.Message)
		}
		return flush()
	}
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
