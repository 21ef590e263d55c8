package payment

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// expiryBatch is how many intents one expiry transaction takes.
const expiryBatch = 100

// kickExpiry wakes the expiry loop: a deadline was heard that has passed
// already. Called inside the inbox transaction, before it commits; the
// loop's next pass, or the one after, sees the row.
func (s *Service) kickExpiry() {
	select {
	case s.expiryKick <- struct{}{}:
	default: // a kick is pending already
	}
}

// runExpiry expires open intents whose deadline, and the CaptureGrace after
// it, have passed, until ctx ends: each becomes EXPIRED and its
// PaymentExpired is written in the same transaction, under the lock a
// capture takes (expireDueSQL). The grace lets a payment that arrived
// before the deadline be decided after it; a payment that arrives after
// the deadline is refused at once (verdict). It sleeps
// until the next deadline it knows of, or expiryPoll at most (deadlines
// heard meanwhile, copies of the service, a clock that jumped). Several
// copies may run: each intent is expired once.
func (s *Service) runExpiry(ctx context.Context) error {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.expiryKick:
			timer.Stop()
			// The kick comes before its transaction commits.
			time.Sleep(refundKickDelay)
		case <-timer.C:
		}
		wait := s.expiryPoll
		for ctx.Err() == nil {
			n, err := s.expireDue(ctx)
			if err != nil {
				if ctx.Err() == nil {
					s.log.Error("expire due payment intents", "err", err)
				}
				break
			}
			if n < expiryBatch {
				next, err := nextDeadline(ctx, s.pool)
				if err == nil && next != nil {
					wait = min(wait, max(next.Add(s.cfg.CaptureGrace).Sub(s.cfg.Now()), time.Millisecond))
				}
				break
			}
		}
		timer.Reset(wait)
	}
}

// expireDue expires up to expiryBatch due intents in one transaction and
// returns how many. Each expiry continues its order's trace (kept with the
// intent when it opened), so PaymentExpired, and the order's close it
// causes, are in the order's trace.
func (s *Service) expireDue(ctx context.Context) (int, error) {
	var expired []Intent
	var spans []trace.Span
	defer func() {
		for _, sp := range spans {
			sp.End()
		}
	}()
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		now := s.cfg.Now()
		rows, _ := tx.Query(ctx, expireDueSQL, now.Add(-s.cfg.CaptureGrace), expiryBatch)
		var traces []map[string]string
		for rows.Next() {
			var in Intent
			var traced map[string]string
			if err := rows.Scan(&in.OrderID, &in.IntentID, &in.State, &in.Amount, &in.UpdatedAt, &in.PayBy, &traced); err != nil {
				rows.Close()
				return fmt.Errorf("expire intents: %w", err)
			}
			expired, traces = append(expired, in), append(traces, traced)
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("expire intents: %w", err)
		}
		if len(expired) == 0 {
			return nil
		}
		b := &pgx.Batch{}
		for i, in := range expired {
			ctx, span := s.tracer.Start(traceContext.Extract(ctx, propagation.MapCarrier(traces[i])), "payment intent expired",
				trace.WithAttributes(attribute.String("shop.order_id", in.OrderID)))
			spans = append(spans, span)
			if err := s.outbox.Queue(ctx, b, expiredEvent(in, now)); err != nil {
				return err
			}
		}
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return 0, err
	}
	for _, in := range expired {
		s.log.Info("payment intent expired", "order_id", in.OrderID, "pay_by", in.PayBy)
	}
	return len(expired), nil
}

// nextDeadline returns the earliest deadline of an open intent, or nil.
func nextDeadline(ctx context.Context, db DB) (*time.Time, error) {
	var next *time.Time
	err := db.QueryRow(ctx, `SELECT min(pay_by) FROM intents WHERE state = 'PAYABLE' AND pay_by IS NOT NULL`).Scan(&next)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("next payment deadline: %w", err)
	}
	return next, nil
}
