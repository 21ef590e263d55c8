package payment

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Every type the consumer declares it handles reaches a case of its own; one
// without is an error naming the file, never the close of the intent that a
// catch-all would make of it.
func TestEveryHandledTypeHasACase(t *testing.T) {
	e := newEnv(t)
	total, payBy := int64(100), time.Now().Add(time.Hour)
	ev := orderEvent{OrderID: "order-1", Total: &total, Amount: &total, PayBy: &payBy}
	for _, typ := range append(slices.Clone(handledTypes), "OrderShipped") {
		if typ == typeRefundRequested {
			continue // decided by handle itself: it reads the payment first
		}
		b := &pgx.Batch{}
		err := e.svc.queueIntent(context.Background(), b, typ, ev)
		handled := typ != "OrderShipped"
		switch {
		case handled && (err != nil || b.Len() == 0):
			t.Errorf("%s, which handledTypes declares: err %v, %d statements queued", typ, err, b.Len())
		case !handled && (err == nil || !strings.Contains(err.Error(), "services/payment/events.go")):
			t.Errorf("%s, which no case handles: err %v, want one naming services/payment/events.go", typ, err)
		}
	}
}
