package loyalty

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/pgtest"
)

// The two streams have no order between them: every order of arrival of an
// order's events — a refund before its payment, a payment before the
// order, a completion before either, a rejected payment's refund that no
// success ever matches — ends in the same points, and the customer's
// balance is the sum of the awards each announced by one PointsAwarded.
func TestEveryOrderOfArrivalEndsInTheSamePoints(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, Registration.Sets()...)
	s := &Service{pool: db.Pool, cfg: Config{CentsPerPoint: 100}, outbox: outbox.Writer{Prefix: prefix}}
	ctx := t.Context()

	events := []struct{ typ, data string }{
		{"OrderCreated", `{"customer_id":"CUSTOMER","total":2500}`},
		{"OrderCompleted", `{}`},
		{"PaymentSucceeded", `{"payment_id":"pay-N","amount":2500}`},
		{"PaymentRefunded", `{"payment_id":"pay-N","amount":1000}`},
		{"PaymentRefunded", `{"payment_id":"rejected-N","amount":999}`},
	}
	const want = (2500 - 1000) / 100
	n := 0
	for _, perm := range permutations(len(events)) {
		n++
		order, customer := fmt.Sprintf("order-%d", n), fmt.Sprintf("c-%d", n)
		for _, i := range perm {
			m := inbox.Message{Type: events[i].typ, AggregateID: order, Data: []byte(strings.NewReplacer("CUSTOMER", customer, "N", order).Replace(events[i].data))}
			if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return s.handle(ctx, tx, m) }); err != nil {
				t.Fatalf("arrival %v: %s: %v", perm, m.Type, err)
			}
		}
		var points, awarded, announced int64
		err := db.Pool.QueryRow(ctx, `SELECT (SELECT points FROM points WHERE customer_id = $1),
			(SELECT sum(points) FROM awards WHERE customer_id = $1),
			(SELECT count(*) FROM outbox WHERE aggregate_id = $2 AND event_type = 'PointsAwarded')`, customer, order).
			Scan(&points, &awarded, &announced)
		if err != nil {
			t.Fatal(err)
		}
		if points != want || awarded != want {
			t.Errorf("arrival %v: %d points, awards %d, want %d", perm, points, awarded, want)
		}
		if announced < 1 {
			t.Errorf("arrival %v: no PointsAwarded", perm)
		}
	}
	if n != 120 {
		t.Fatalf("tried %d orders of arrival, want 120", n)
	}
}

// permutations lists every order of 0..n-1.
func permutations(n int) [][]int {
	if n == 0 {
		return [][]int{{}}
	}
	var out [][]int
	for _, p := range permutations(n - 1) {
		for i := 0; i <= len(p); i++ {
			q := append(append(append([]int{}, p[:i]...), n-1), p[i:]...)
			out = append(out, q)
		}
	}
	return out
}
