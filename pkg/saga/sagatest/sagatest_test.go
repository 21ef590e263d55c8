package sagatest_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/internal/testenv"
	"github.com/shop-ref/shop/pkg/saga"
	"github.com/shop-ref/shop/pkg/saga/migrations"
	"github.com/shop-ref/shop/pkg/saga/sagatest"
)

// A ticket is held for an hour, then expires; a "broken" ticket's expiry
// always fails.
func TestFireTimeout(t *testing.T) {
	t.Parallel()
	db := testenv.New(t, testenv.Migrations{Table: "saga_goose_version", FS: migrations.FS()})
	ctx := context.Background()
	hold := func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
		st.SetTimeout("hold", time.Now().Add(time.Hour))
		return nil
	}
	ticket, err := saga.New("ticket",
		saga.Transition{From: "OPEN", Event: "Reserve", To: "HELD", Func: hold},
		saga.Transition{From: "HELD", Event: saga.TimeoutEvent("hold"), To: "EXPIRED"})
	if err != nil {
		t.Fatal(err)
	}
	broken, err := saga.New("broken",
		saga.Transition{From: "OPEN", Event: "Reserve", To: "HELD", Func: hold},
		saga.Transition{From: "HELD", Event: saga.TimeoutEvent("hold"), To: "EXPIRED",
			Func: func(context.Context, pgx.Tx, *saga.Step) error { return errors.New("the expiry is broken") }})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []struct {
		sg *saga.Saga
		id string
	}{{ticket, "t-1"}, {ticket, "t-2"}, {broken, "b-1"}} {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if err := s.sg.Start(ctx, tx, s.id, "OPEN", nil); err != nil {
				return err
			}
			if s.id == "t-2" { // left OPEN, with an event it does not expect
				_, err := s.sg.Apply(ctx, tx, s.id, saga.Event{Type: "Pay", ID: "ev-1"})
				return err
			}
			_, err := s.sg.Apply(ctx, tx, s.id, saga.Event{Type: "Reserve", ID: "ev-0"})
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}

	if due := sagatest.RequireTimeout(t, db.Pool, "t-1", "hold"); time.Until(due) < 59*time.Minute {
		t.Fatalf("hold due at %v, want in an hour", due)
	}
	in := sagatest.FireTimeout(t, db.Pool, ticket, "t-1", "hold")
	if in.State != "EXPIRED" || in.Version != 3 {
		t.Fatalf("after the hold fired: %+v, want EXPIRED at version 3", in)
	}
	if got := sagatest.Timeouts(t, db.Pool, "t-1"); len(got) != 0 {
		t.Fatalf("timeouts left: %v", got)
	}
	if got := sagatest.UnexpectedEvents(t, db.Pool, "t-2"); len(got) != 1 || got[0] != (sagatest.Unexpected{State: "OPEN", EventType: "Pay", EventID: "ev-1"}) {
		t.Fatalf("unexpected events of t-2: %+v", got)
	}

	if m := fails(t, func(t testing.TB) { sagatest.FireTimeout(t, db.Pool, ticket, "t-2", "hold") }); !strings.Contains(m, "no timeout") {
		t.Errorf("firing a timeout not armed: %q", m)
	}
	if m := fails(t, func(t testing.TB) { sagatest.RequireTimeout(t, db.Pool, "t-2", "hold") }); !strings.Contains(m, "no timeout") {
		t.Errorf("requiring a timeout not armed: %q", m)
	}
	if m := fails(t, func(t testing.TB) { sagatest.FireTimeout(t, db.Pool, broken, "b-1", "hold") }); !strings.Contains(m, "the expiry is broken") {
		t.Errorf("firing a timeout whose transition fails: %q", m)
	}
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
