package chaos

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Acked events missing from streams. The relay marks an event published on
// its PubAck; a broker that then loses the message (a node killed before
// its fsync, a stream leader's log cut back by a new election) leaves an
// event the outbox thinks delivered and no consumer will see. After the
// chaos the harness audits every stream against its outbox, republishes
// what is missing as the reconciler does (outbox.RepublishAll), and audits
// again: missing after the repair must be 0.

// StreamLoss is what the audit found before and after the repair.
type StreamLoss struct {
	Before, After int
	Notes         []string // the lost events before the repair, at most 10
}

func (h *harness) auditStreams(ctx context.Context) (StreamLoss, error) {
	// As `shop verify` does: the read-only audit user.
	nc, err := h.nats.connect(broker.AuditUser)
	if err != nil {
		return StreamLoss{}, fmt.Errorf("audit: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return StreamLoss{}, fmt.Errorf("audit: %w", err)
	}
	audit := func() (map[string][]uuid.UUID, []string, int, error) {
		audits, err := verify.AuditStreams(ctx, h.shop, js, verify.AuditConfig{Window: app.OutboxRetention})
		if err != nil {
			return nil, nil, 0, err
		}
		lost := map[string][]uuid.UUID{}
		var notes []string
		n := 0
		for _, a := range audits {
			if a.Err != nil {
				return nil, nil, 0, fmt.Errorf("audit of %s: %w", a.Stream, a.Err)
			}
			for _, l := range a.Lost {
				lost[a.Service] = append(lost[a.Service], l.EventID)
				if len(notes) < 10 {
					notes = append(notes, l.String())
				}
				n++
			}
		}
		return lost, notes, n, nil
	}
	lost, notes, before, err := audit()
	if err != nil || before == 0 {
		return StreamLoss{Notes: notes}, err
	}
	h.logf("chaos: %d acked events missing from their streams; republishing them", before)
	for service, ids := range lost {
		pool, err := h.shop.Pool(service)
		if err != nil {
			return StreamLoss{}, fmt.Errorf("audit: %w", err)
		}
		if _, err := outbox.RepublishAll(ctx, pool, ids); err != nil {
			return StreamLoss{}, err
		}
	}
	// The relays publish them again; the audit looks once they are marked.
	after := before
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) && sleepCtx(ctx, time.Second) {
		if _, _, after, err = audit(); err != nil {
			return StreamLoss{}, err
		}
		if after == 0 {
			break
		}
	}
	return StreamLoss{Before: before, After: after, Notes: notes}, nil
}
