package reconcile

import (
	"fmt"
	"slices"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/outbox"
)

// lostEvents audits every stream against its outbox.
func (r *run) lostEvents() error {
	audits, err := verify.AuditStreams(r.ctx, r.shop, r.cfg.JetStream,
		verify.AuditConfig{Window: r.cfg.Retention, Newest: r.cfg.AuditNewest})
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	r.audits = audits
	for _, a := range audits {
		for _, l := range a.Lost {
			f := Finding{Kind: LostEvent, Event: &l, Detail: l.String()}
			if l.AggregateType == "order" {
				f.OrderID = l.AggregateID
			}
			r.findings = append(r.findings, f)
		}
	}
	return nil
}

// repairLost republishes every event a stream lost, one statement per
// service, so that service's relays see all of the copies or none.
func (r *run) repairLost() error {
	for _, service := range r.shop.Services.Names() {
		var ids []uuid.UUID
		for _, f := range r.findings {
			if f.Event != nil && f.Event.Service == service {
				ids = append(ids, f.Event.EventID)
			}
		}
		if len(ids) == 0 {
			continue
		}
		pool, err := r.shop.Pool(service)
		if err != nil {
			return fmt.Errorf("reconcile: %w", err)
		}
		marked, err := outbox.RepublishAll(r.ctx, pool, ids)
		if err != nil {
			return fmt.Errorf("reconcile: %s: %w", service, err)
		}
		for i := range r.findings {
			if f := &r.findings[i]; f.Event != nil && f.Event.Service == service && slices.Contains(marked, f.Event.EventID) {
				f.Republished = 1
			}
		}
		r.total += len(marked)
	}
	return nil
}
