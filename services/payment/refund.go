package payment

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/failpoint"
)

// refundKickDelay is how long after a kick the refund loop looks. The kick
// comes from inside the inbox transaction, before it commits, so looking at
// once would usually miss the row; a kick that is still too early costs one
// poll interval, nothing more.
const refundKickDelay = 50 * time.Millisecond

// refundBatch is how many refunds one pass claims.
const refundBatch = 10

func (s *Service) kickRefunds() {
	select {
	case s.kick <- struct{}{}:
	default: // a kick is pending already
	}
}

// runRefunds calls the provider for every REQUESTED refund that is due,
// until ctx ends. Several instances may run: claims skip each other's rows.
func (s *Service) runRefunds(ctx context.Context) error {
	tick := time.NewTicker(s.refundPoll)
	defer tick.Stop()
	soon := time.NewTimer(0) // a first pass at start: refunds left open by a crash
	defer soon.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.kick:
			soon.Reset(refundKickDelay)
			continue
		case <-tick.C:
		case <-soon.C:
		}
		for ctx.Err() == nil {
			n := s.refundDue(ctx)
			if n < refundBatch {
				break
			}
		}
	}
}

// refundDue claims due refunds and attempts each; it returns how many it
// claimed.
func (s *Service) refundDue(ctx context.Context) int {
	// The lease outlasts the provider call, so no other instance calls
	// for the same refund while this one waits for an answer.
	rs, err := claimRefunds(ctx, s.pool, refundBatch, 2*s.refundCall)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("claim refunds", "err", err)
		}
		return 0
	}
	for _, r := range rs {
		s.attemptRefund(ctx, r)
	}
	return len(rs)
}

// attemptRefund calls the provider once for r, outside any transaction,
// with r's idempotency key, then records the outcome.
func (s *Service) attemptRefund(ctx context.Context, r Refund) {
	callCtx, cancel := context.WithTimeout(ctx, s.refundCall)
	providerRefundID, callErr := s.provider.Refund(callCtx, r.IdempotencyKey.String(), r.Amount)
	cancel()

	// The call has happened: record its outcome even if we are shutting
	// down, or a done refund would wait for a lease to expire.
	ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()

	log := s.log.With("order_id", r.OrderID, "refund_id", r.RefundID, "attempt", r.Attempts)
	if callErr != nil {
		// Failed or ambiguous (a timeout may have refunded): either way the
		// next attempt uses the same key, so the provider refunds at most once.
		retryIn := s.refundRetryDelay(r.Attempts)
		log.Warn("refund attempt failed", "err", callErr, "retry_in", retryIn)
		if err := failRefund(ctx, s.pool, r.RefundID, callErr.Error(), retryIn); err != nil {
			log.Error("record refund failure", "err", err) // the lease expires and it is retried anyway
		}
		return
	}
	// Failure window: the provider has refunded, we have not stored it. An
	// injected error abandons the refund as a crash would: it stays
	// REQUESTED under its lease, and once the lease expires the retry asks
	// the provider again with the same key and gets the same refund back.
	if err := s.hooks.Failpoint(failpoint.PaymentRefundAfterProviderBeforeStore); err != nil {
		log.Warn("payment failpoint: refund outcome not stored", "err", err)
		return
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		done, err := completeRefund(ctx, tx, r.RefundID, providerRefundID)
		if err != nil || !done {
			return err // !done: another instance completed it and emitted the event
		}
		return s.outbox.Add(ctx, tx, refundedEvent(r, s.cfg.Now()))
	})
	if err != nil {
		// The refund stays REQUESTED; the retry asks the provider again with
		// the same key and gets the same refund back.
		log.Error("record refund", "err", err)
		return
	}
	log.Info("refund done", "amount", r.Amount)
}

// refundRetryDelay is the wait after the attempt-th failed attempt:
// doubling from refundBackoff, capped at refundBackoffMx, so a provider
// outage is not hammered.
func (s *Service) refundRetryDelay(attempt int) time.Duration {
	d := s.refundBackoff
	for i := 1; i < attempt && d < s.refundBackoffMx; i++ {
		d *= 2
	}
	return min(d, s.refundBackoffMx)
}
