package chaos

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The hostile lane: a peer that misbehaves the way a buggy producer could —
// it publishes into ORDERS with the order service's rights — sends, at a
// steady rate while the chaos lasts,
//
//   - early events: sequence 2 or later of orders that do not exist, and a
//     far sequence of real orders (one that order will never reach);
//   - conflicting events: a new event id at sequence 1 of an order whose
//     saga has ended and whose real OrderCreated every reader applied;
//   - oversized events: early ones with a 256 KiB payload;
//   - garbage: a message without the contract's headers.
//
// None of them may stop or change a real order. After the run, an operator
// (the harness) discards what they left, with a reason: the parked events
// and the dead letters of the event ids it forged, and the dead letters of
// its garbage. Only then does verify run: the real traffic must show no
// violation. (Conflicts are aimed only at orders whose sequence 1 is applied: a forged event at
// the sequence of an order still in flight could take that sequence before
// the real event, and the real one would be the conflict — what the
// consumer must not, and does not, decide by itself.)

// Hostile counts what the lane sent and what the shop made of it.
type Hostile struct {
	Early, Conflicting, Oversized, Garbage int // sent
	Refused                                int // not acked (the broker was away: it is chaos); perhaps stored all the same
	Parked, Conflicts, DeadLetters         int // found afterwards, discarded
}

type hostile struct {
	h   *harness
	js  jetstream.JetStream
	mu  sync.Mutex
	ids map[uuid.UUID]bool // every event id it forged
	n   Hostile
}

// newHostile is the hostile peer, publishing over nc.
func newHostile(h *harness, nc *nats.Conn) (*hostile, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("hostile peer: %w", err)
	}
	return &hostile{h: h, js: js, ids: map[uuid.UUID]bool{}}, nil
}

// hostileLane sends one hostile message every 400 ms or so until ctx ends.
func (h *harness) hostileLane(ctx context.Context, p *hostile) {
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(300+mrand.IntN(200)) * time.Millisecond):
		}
		var err error
		switch i % 5 {
		case 0, 1:
			err = p.early(ctx, i)
		case 2:
			err = p.conflicting(ctx)
		case 3:
			err = p.oversized(ctx, i)
		case 4:
			err = p.garbage(ctx, i)
		}
		if err != nil && ctx.Err() == nil {
			p.count(func(n *Hostile) { n.Refused++ })
		}
	}
}

func (p *hostile) publish(ctx context.Context, m *nats.Msg, id uuid.UUID) error {
	p.mu.Lock()
	p.ids[id] = true
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	_, err := p.js.PublishMsg(ctx, m, jetstream.WithMsgID(id.String()))
	return err
}

// event builds a message with the contract's headers, as a producer's
// relay would.
func event(id uuid.UUID, aggregate, typ string, seq int64, payload []byte) *nats.Msg {
	m := nats.NewMsg("orders." + aggregate + "." + typ)
	m.Header.Set("Event-Type", typ)
	m.Header.Set("Aggregate-Type", "order")
	m.Header.Set("Aggregate-Id", aggregate)
	m.Header.Set("Aggregate-Seq", fmt.Sprint(seq))
	m.Header.Set("Schema-Version", "1")
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339Nano))
	m.Data = payload
	return m
}

func (p *hostile) early(ctx context.Context, i int) error {
	id := uuid.Must(uuid.NewV7())
	agg, seq := fmt.Sprintf("forged-%d", i), int64(2+i%4)
	if i%2 == 1 {
		if real, ok := p.someOrder(ctx, false); ok {
			agg, seq = real, 1000 // a real order never gets that far
		}
	}
	payload := fmt.Appendf(nil, `{"order_id":%q}`, agg)
	if err := p.publish(ctx, event(id, agg, "OrderCreated", seq, payload), id); err != nil {
		return fmt.Errorf("early %s/%d: %w", agg, seq, err)
	}
	p.count(func(n *Hostile) { n.Early++ })
	return nil
}

func (p *hostile) conflicting(ctx context.Context) error {
	agg, ok := p.someOrder(ctx, true)
	if !ok {
		return nil // no such order yet
	}
	id := uuid.Must(uuid.NewV7())
	payload := fmt.Appendf(nil, `{"order_id":%q,"customer_id":"forged","items":[],"total":0}`, agg)
	if err := p.publish(ctx, event(id, agg, "OrderCreated", 1, payload), id); err != nil {
		return fmt.Errorf("conflicting %s/1: %w", agg, err)
	}
	p.count(func(n *Hostile) { n.Conflicting++ })
	return nil
}

func (p *hostile) oversized(ctx context.Context, i int) error {
	id := uuid.Must(uuid.NewV7())
	agg := fmt.Sprintf("forged-big-%d", i)
	payload := fmt.Appendf(nil, `{"order_id":%q,"blob":%q}`, agg, strings.Repeat("x", 256<<10))
	if err := p.publish(ctx, event(id, agg, "OrderCreated", 3, payload), id); err != nil {
		return fmt.Errorf("oversized %s: %w", agg, err)
	}
	p.count(func(n *Hostile) { n.Oversized++ })
	return nil
}

func (p *hostile) garbage(ctx context.Context, i int) error {
	id := uuid.Must(uuid.NewV7())
	m := nats.NewMsg(fmt.Sprintf("orders.forged-garbage-%d.Nonsense", i))
	m.Header.Set("Event-Type", "Nonsense") // no aggregate, no sequence: poison
	m.Data = []byte("not json")
	if err := p.publish(ctx, m, id); err != nil {
		return fmt.Errorf("garbage: %w", err)
	}
	p.count(func(n *Hostile) { n.Garbage++ })
	return nil
}

func (p *hostile) count(f func(*Hostile)) {
	p.mu.Lock()
	f(&p.n)
	p.mu.Unlock()
}

// someOrder picks a real order: any, or (applied) one whose OrderCreated
// every consumer of ORDERS has already applied. Only such an order is a fair
// target for a forged sequence 1: "ended" in the order service is not enough,
// since an order rejected by inventory ends while payment, perhaps down in
// the process lane, has not yet read its OrderCreated; the forged event would
// then take sequence 1 first and the real one be the conflict (seen in CI).
func (p *hostile) someOrder(ctx context.Context, applied bool) (string, bool) {
	where := ""
	if applied {
		where = `JOIN ` + p.h.schema("order") + `.outbox e
			ON e.aggregate_type = 'order' AND e.aggregate_id = o.order_id::text AND e.aggregate_seq = 1
			WHERE o.status IN ('COMPLETED', 'CLOSED', 'REJECTED')`
		for service, consumer := range p.h.orderConsumers() {
			where += ` AND EXISTS (SELECT 1 FROM ` + p.h.schema(service) + `.processed_events p
				WHERE p.consumer_name = '` + consumer + `' AND p.event_id = e.event_id)`
		}
	}
	var id string
	err := p.h.admin.QueryRow(ctx, `SELECT o.order_id::text FROM `+p.h.schema("order")+`.orders o `+where+
		` ORDER BY random() LIMIT 1`).Scan(&id)
	return id, err == nil
}

// orderConsumers are the services whose consumer reads the order events a
// forged one would collide with: every consumer of ORDERS that receives
// OrderCreated (one that filters on other types, fulfillment's on
// OrderPaid, never sees a forged OrderCreated), by service.
func (h *harness) orderConsumers() map[string]string {
	out := map[string]string{}
	for _, r := range h.cfg.Services.Readers() {
		if r.Stream == "ORDERS" && (len(r.Types) == 0 || slices.Contains(r.Types, "OrderCreated")) {
			out[r.Service] = r.Name
		}
	}
	return out
}

// schema is the quoted schema of service, for the harness's own queries.
func (h *harness) schema(service string) string {
	e, err := h.cfg.Services.Get(service)
	if err != nil {
		panic(err) // the harness names only the shop's own services
	}
	return pgx.Identifier{e.Schema}.Sanitize()
}

// cleanUp discards, as an operator would once they are known to be forged,
// the parked events and dead letters the lane left, and counts them.
func (p *hostile) cleanUp(ctx context.Context) (Hostile, error) {
	p.mu.Lock()
	ids := make([]uuid.UUID, 0, len(p.ids))
	for id := range p.ids {
		ids = append(ids, id)
	}
	n := p.n
	p.mu.Unlock()
	for _, r := range p.h.cfg.Services.Readers() {
		if r.Stream != "ORDERS" {
			continue // the lane forges order events only
		}
		service, s := r.Service, p.h.schema(r.Service)
		tag, err := p.h.admin.Exec(ctx, `UPDATE `+s+`.inbox_parked SET discarded_at = now(), discard_reason = 'chaos: forged by the hostile lane'
			WHERE discarded_at IS NULL AND event_id = ANY($1)`, ids)
		if err != nil {
			return n, fmt.Errorf("discard parked events of %s: %w", service, err)
		}
		n.Parked += int(tag.RowsAffected())
		var dead, conflicts int
		err = p.h.admin.QueryRow(ctx, `WITH d AS (
				UPDATE `+s+`.dead_letters SET resolved_at = now(), discarded_at = now(),
				       discard_reason = 'chaos: forged by the hostile lane'
				WHERE resolved_at IS NULL AND (event_id = ANY($1) OR subject LIKE 'orders.forged-garbage-%')
				RETURNING conflict_with)
			SELECT count(*), count(conflict_with) FROM d`, ids).Scan(&dead, &conflicts)
		if err != nil {
			return n, fmt.Errorf("discard dead letters of %s: %w", service, err)
		}
		n.DeadLetters += dead
		n.Conflicts += conflicts
	}
	return n, nil
}
