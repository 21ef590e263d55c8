package outboxtest_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/shop-ref/shop/pkg/internal/testenv"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/outbox/migrations"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
)

func TestRequireWritten(t *testing.T) {
	t.Parallel()
	db := testenv.New(t, testenv.Migrations{Table: "outbox_goose_version", FS: migrations.FS()})
	ctx := context.Background()
	events := outbox.Writer{Prefix: "orders"}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, typ := range []string{"OrderCreated", "OrderPaid"} {
		if err := events.Add(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: "o-1", Type: typ, Payload: map[string]int{"total": 3}}); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("the transaction sees its own event", func(t *testing.T) {
		rec := outboxtest.RequireWritten(t, tx, outboxtest.Want{AggregateID: "o-1", Type: "OrderPaid"})
		if rec.Seq != 2 || rec.Subject != "orders.o-1.OrderPaid" || string(rec.Payload) != `{"total":3}` {
			t.Fatalf("got %+v", rec)
		}
	})
	t.Run("others do not before it commits", func(t *testing.T) {
		outboxtest.RequireNotWritten(t, db.Pool, outboxtest.Want{AggregateID: "o-1"})
	})
	t.Run("Written lists in sequence order", func(t *testing.T) {
		var got []string
		for _, r := range outboxtest.Written(t, tx, outboxtest.Want{AggregateType: "order"}) {
			got = append(got, fmt.Sprint(r.Seq, r.Type))
		}
		if strings.Join(got, " ") != "1OrderCreated 2OrderPaid" {
			t.Fatalf("got %v", got)
		}
	})
	t.Run("two matches fail RequireWritten", func(t *testing.T) {
		msg := fails(t, func(t testing.TB) { outboxtest.RequireWritten(t, tx, outboxtest.Want{AggregateID: "o-1"}) })
		if !strings.Contains(msg, "2 events written") || !strings.Contains(msg, "order/o-1 #2 OrderPaid") {
			t.Fatalf("message %q", msg)
		}
	})
	t.Run("none fails RequireWritten", func(t *testing.T) {
		if msg := fails(t, func(t testing.TB) { outboxtest.RequireWritten(t, tx, outboxtest.Want{Type: "OrderShipped"}) }); !strings.Contains(msg, "0 events written") {
			t.Fatalf("message %q", msg)
		}
	})
	t.Run("a match fails RequireNotWritten", func(t *testing.T) {
		if msg := fails(t, func(t testing.TB) { outboxtest.RequireNotWritten(t, tx, outboxtest.Want{Type: "OrderCreated"}) }); !strings.Contains(msg, "want none") {
			t.Fatalf("message %q", msg)
		}
	})
}

// fails runs f with a TB that records a fatal failure instead of failing t,
// and returns its message; it fails t when f does not fail.
func fails(t *testing.T, f func(testing.TB)) string {
	t.Helper()
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	if r.msg == "" {
		t.Fatal("the assertion passed; want it to fail")
	}
	return r.msg
}

type recorder struct {
	testing.TB
	msg string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}
