package fulfillment

import (
	"context"
	"time"
)

// runDeliveries is the delivery scanner: until ctx ends it delivers due
// shipments, polling every Config.pollInterval. The timer is the deliver_at
// column, so a shipment that fell due while no scanner ran is delivered on
// the first poll after one starts.
func (s *Service) runDeliveries(ctx context.Context) {
	every := s.cfg.pollInterval()
	t := time.NewTimer(0) // first scan at once: deliver what fell due while down
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for {
			n, err := s.deliverDue(ctx)
			if err != nil {
				if ctx.Err() == nil {
					// Transient (the database is down or busy): the rows
					// are still due, so the next poll tries them again.
					s.log.Warn("deliver due shipments", "err", err)
				}
				break
			}
			if n < deliverBatch {
				break // drained; a full batch means more may be due now
			}
		}
		t.Reset(every)
	}
}
