package saga_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shop-ref/shop/pkg/saga"
)

func TestFailpointAfterClaimTimeout(t *testing.T) {
	t.Parallel()
	e := setup(t, 50*time.Millisecond)
	e.start(t, "a")
	e.apply(t, "a", "Reserve")
	time.Sleep(80 * time.Millisecond) // the hold is due

	injected := errors.New("injected")
	var hits atomic.Int32
	sc, err := saga.NewScanner(e.db.Pool, saga.ScannerConfig{
		PollInterval: 10 * time.Millisecond,
		Hooks: saga.Hooks{FailpointFunc: func(name string) error {
			if name == "saga.after_claim_timeout" && hits.Add(1) == 1 {
				return fmt.Errorf("failpoint %s: %w", name, injected)
			}
			return nil
		}},
	}, e.ticket)
	if err != nil {
		t.Fatal(err)
	}
	// The scanner "dies" after claiming the timeout: nothing fired, the
	// timeout is still due, not postponed.
	fired, err := sc.FireOne(context.Background())
	if fired || !errors.Is(err, injected) {
		t.Fatalf("FireOne: fired %v, err %v; want the injected error", fired, err)
	}
	e.wantState(t, "a", "HELD", 2)
	if n := e.count(t, `SELECT count(*) FROM saga_timeouts WHERE due_at <= now()`); n != 1 {
		t.Fatalf("%d due timeouts after the abandoned claim, want 1", n)
	}

	// Later scans fire it, once.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sc.Run(ctx) }()
	eventually(t, "the hold to expire", func() bool {
		in, err := saga.Load(context.Background(), e.db.Pool, "a")
		return err == nil && in.State == "EXPIRED"
	})
	time.Sleep(50 * time.Millisecond) // a few more scans
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if sc.Fired() != 1 || hits.Load() != 2 {
		t.Fatalf("fired %d, failpoint hit %d times; want 1 and 2", sc.Fired(), hits.Load())
	}
	if n := e.count(t, `SELECT count(*) FROM effects WHERE event = $1`, saga.TimeoutEvent("hold")); n != 1 {
		t.Fatalf("the timeout's transition ran %d times, want 1", n)
	}
	if n := e.count(t, `SELECT count(*) FROM effects WHERE to_state = 'EXPIRED'`); n != 1 {
		t.Fatalf("%d effects of the expiry, want 1", n)
	}
	if n := e.count(t, `SELECT count(*) FROM saga_timeouts`); n != 0 {
		t.Fatalf("%d timeouts left after firing", n)
	}
}
