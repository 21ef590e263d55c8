package inboxtest_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/inbox/inboxtest"
	"github.com/shop-ref/shop/pkg/inbox/migrations"
	"github.com/shop-ref/shop/pkg/internal/testenv"
)

// A real consumer processes two events of o-1; the kit sees them processed
// and the sequence they reached, and an event never sent not processed.
func TestRequireProcessed(t *testing.T) {
	t.Parallel()
	db := testenv.New(t, testenv.Migrations{Table: "inbox_goose_version", FS: migrations.FS()})
	srv := testenv.NATS(t)
	_, js := srv.Connect(t)
	srv.Stream(t, js, "ORDERS", "orders.>")
	c, err := inbox.NewConsumer(db.Pool, js, inbox.Config{
		Name: "kit", Stream: "ORDERS", Logger: slog.New(slog.DiscardHandler),
		Handler: func(context.Context, pgx.Tx, []inbox.Batched) error { return nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-stopped })

	ids := []uuid.UUID{uuid.New(), uuid.New()}
	for i, id := range ids {
		testenv.Publish(t, js, msg(id, int64(i+1)))
	}
	deadline := time.Now().Add(10 * time.Second)
	for c.Counters().Processed < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the consumer did not process both events")
		}
		time.Sleep(10 * time.Millisecond)
	}

	for _, id := range ids {
		inboxtest.RequireProcessed(t, db.Pool, "kit", id)
	}
	never := uuid.New()
	inboxtest.RequireNotProcessed(t, db.Pool, "kit", never)
	inboxtest.RequireNotProcessed(t, db.Pool, "another consumer", ids[0])
	if got := inboxtest.Processed(t, db.Pool, "kit"); len(got) != 2 || !slices.Contains(got, ids[0]) || !slices.Contains(got, ids[1]) {
		t.Errorf("Processed: %v, want %v", got, ids)
	}
	if seq := inboxtest.LastSeq(t, db.Pool, "kit", "orders", "order", "o-1"); seq != 2 {
		t.Errorf("LastSeq: %d, want 2", seq)
	}
	if seq := inboxtest.LastSeq(t, db.Pool, "kit", "orders", "order", "o-2"); seq != 0 {
		t.Errorf("LastSeq of an aggregate never seen: %d, want 0", seq)
	}
	if m := fails(t, func(t testing.TB) { inboxtest.RequireProcessed(t, db.Pool, "kit", never) }); !strings.Contains(m, "has not processed") {
		t.Errorf("RequireProcessed of an event never sent: %q", m)
	}
	if m := fails(t, func(t testing.TB) { inboxtest.RequireNotProcessed(t, db.Pool, "kit", ids[1]) }); !strings.Contains(m, "want not") {
		t.Errorf("RequireNotProcessed of a processed event: %q", m)
	}
}

// msg is the seq-th event of order o-1 as an outbox relay publishes it.
func msg(id uuid.UUID, seq int64) *nats.Msg {
	m := nats.NewMsg("orders.o-1.OrderUpdated")
	m.Header.Set(jetstream.MsgIDHeader, id.String())
	m.Header.Set("Event-Type", "OrderUpdated")
	m.Header.Set("Aggregate-Type", "order")
	m.Header.Set("Aggregate-Id", "o-1")
	m.Header.Set("Aggregate-Seq", fmt.Sprint(seq))
	m.Header.Set("Schema-Version", "1")
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339Nano))
	m.Data = []byte(`{}`)
	return m
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
