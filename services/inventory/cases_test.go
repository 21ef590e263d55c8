package inventory

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// Every type the consumer declares it handles reaches a case of its own in
// apply; one without is an error naming the file, never the release of the
// order's stock that a catch-all would make of it.
func TestEveryHandledTypeHasACase(t *testing.T) {
	f := setup(t)
	ctx := context.Background()
	for _, typ := range append(handledTypes, "OrderShipped") {
		err := pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
			st, err := lockBatchState(ctx, tx, []string{"A"}, []string{"order-1"})
			if err != nil {
				t.Fatal(err)
			}
			ev := orderEvent{OrderID: "order-1", Items: []Item{{"A", 1}}}
			return f.svc.apply(ctx, st, st.newWrite(), typ, ev)
		})
		handled := typ != "OrderShipped"
		switch {
		case handled && err != nil:
			t.Errorf("%s, which handledTypes declares: %v", typ, err)
		case !handled && (err == nil || !strings.Contains(err.Error(), "services/inventory/handle.go")):
			t.Errorf("%s, which no case handles: err %v, want one naming services/inventory/handle.go", typ, err)
		}
	}
}
