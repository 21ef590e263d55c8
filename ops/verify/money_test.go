package verify_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// A rejected payment (money the provider took that its order could not
// take) is a violation until its refund is done, and needs its
// PaymentRejected event like every recorded payment.
func TestRejectedPaymentsMustBeRefunded(t *testing.T) {
	t.Parallel()
	pools := shoptest.Schemas(t, services.All)
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pools.Pools["payment"].Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	order, payment := uuid.NewString(), uuid.Must(uuid.NewV7())
	exec(`INSERT INTO payments (payment_id, order_id, provider_payment_id, status, amount, reject_reason)
		VALUES ($1, $2, 'pay_stray', 'rejected', 700, 'unknown_order')`, payment, order)
	exec(`INSERT INTO refunds (refund_id, order_id, payment_id, idempotency_key, amount, state, attempts, last_error)
		VALUES ($1, $2, $3, $3, 700, 'REQUESTED', 3, 'provider unavailable')`, uuid.Must(uuid.NewV7()), order, payment)

	violations := func() map[string][]string {
		t.Helper()
		rep, err := verify.Run(ctx, pools, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		v := map[string][]string{}
		for _, c := range rep.Checks {
			v[c.Name] = c.Violations
		}
		return v
	}
	const refunded, announced = "payment: every rejected payment is refunded", "payment: each rejected payment has exactly one PaymentRejected"
	v := violations()
	want := order + ": rejected payment " + payment.String() + " (unknown_order, 700) is not refunded yet: 3 attempts, last error: provider unavailable"
	if len(v[refunded]) != 1 || v[refunded][0] != want {
		t.Errorf("%s: %q, want %q", refunded, v[refunded], want)
	}
	if len(v[announced]) != 1 {
		t.Errorf("%s: %q, want the missing event", announced, v[announced])
	}

	// The event, and the refund done with its own: nothing to report.
	exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version, subject, payload, published_at)
		VALUES ($1, 'order', $2, 1, 'PaymentRejected', 1, 'payment.' || $2 || '.PaymentRejected', jsonb_build_object('payment_id', $3::text), now())`,
		uuid.Must(uuid.NewV7()), order, payment)
	exec(`UPDATE refunds SET state = 'DONE', provider_refund_id = 're_1', last_error = NULL WHERE payment_id = $1`, payment)
	exec(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, schema_version, subject, payload, published_at)
		SELECT $1, 'order', $2, 2, 'PaymentRefunded', 1, 'payment.' || $2 || '.PaymentRefunded', jsonb_build_object('refund_id', refund_id::text), now()
		FROM refunds WHERE payment_id = $3`, uuid.Must(uuid.NewV7()), order, payment)
	v = violations()
	for _, name := range []string{refunded, announced, "payment: each refund has exactly one PaymentRefunded"} {
		if len(v[name]) != 0 {
			t.Errorf("%s: %q, want none", name, v[name])
		}
	}
}
