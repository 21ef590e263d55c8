package reconcile_test

import (
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/ops/reconcile"
)

// rejected records a payment the payment service could not apply, made ago,
// and its refund in refundState ("" for none) after attempts tries.
func (s *shop) rejected(amount int64, ago, refundState string, attempts int) string {
	s.t.Helper()
	order, payment := uuid.NewString(), uuid.Must(uuid.NewV7())
	s.exec(s.pools.Payment, `INSERT INTO payments (payment_id, order_id, provider_payment_id, status, amount, created_at, reject_reason)
		VALUES ($1, $2, $3, 'rejected', $4, now() - $5::interval, 'amount_mismatch')`, payment, order, "pay_"+order, amount, ago)
	if refundState != "" {
		s.exec(s.pools.Payment, `INSERT INTO refunds (refund_id, order_id, payment_id, idempotency_key, amount, state, attempts, last_error)
			VALUES ($1, $2, $3, $3, $4, $5, $6, CASE WHEN $5 = 'REQUESTED' THEN 'provider unavailable' END)`,
			uuid.Must(uuid.NewV7()), order, payment, amount, refundState, attempts)
	}
	return order
}

// A rejected payment whose money has not gone back after the grace is an
// unrefunded payment: the refund loop keeps trying, a person should look.
func TestRejectedPaymentsNotRefunded(t *testing.T) {
	s := newShop(t)
	failing := s.rejected(700, "10 minutes", "REQUESTED", 4)
	noRefund := s.rejected(300, "10 minutes", "", 0)
	s.rejected(700, "10 minutes", "DONE", 1)    // refunded
	s.rejected(700, "1 minute", "REQUESTED", 1) // within the grace
	s.rejected(0, "10 minutes", "", 0)          // nothing taken

	rep := s.run(true)
	if got, want := found(rep, reconcile.UnrefundedPayment), sorted(failing, noRefund); !equal(got, want) {
		t.Fatalf("unrefunded payments %v, want %v", got, want)
	}
	if rep.Counts.UnrefundedPayments != 2 {
		t.Errorf("counts %+v", rep.Counts)
	}
	for _, f := range rep.Findings {
		switch f.OrderID {
		case failing:
			if !strings.Contains(f.Detail, "rejected (amount_mismatch)") || !strings.Contains(f.Detail, "after 4 attempts (last error: provider unavailable") {
				t.Errorf("finding %v", f)
			}
		case noRefund:
			if !strings.Contains(f.Detail, "has no refund") {
				t.Errorf("finding %v", f)
			}
		}
	}
}

func equal(a, b []string) bool { return strings.Join(a, ",") == strings.Join(b, ",") }
