package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/pkg/internal/testenv"
	"github.com/shop-ref/shop/pkg/saga"
	"github.com/shop-ref/shop/pkg/saga/migrations"
)

// The test saga: a ticket is OPEN, gets HELD for a while (a "hold" timeout),
// then PAID, or EXPIRED when the hold runs out; an OPEN ticket may be
// CANCELLED. Every transition queues an effect row on the step's batch, to
// show that it commits with the state.
type env struct {
	db     *testenv.Schema
	ticket *saga.Saga
	hold   time.Duration
}

func setup(t *testing.T, hold time.Duration) *env {
	t.Helper()
	db := newSchema(t)
	if _, err := db.Pool.Exec(context.Background(),
		`CREATE TABLE effects (saga_id text, from_state text, event text, to_state text, at timestamptz DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	effect := func(extra func(st *saga.Step)) saga.TransitionFunc {
		return func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
			if extra != nil {
				extra(st)
			}
			st.Batch().Queue(`INSERT INTO effects (saga_id, from_state, event, to_state) VALUES ($1, $2, $3, $4)`,
				st.Instance.ID, st.Instance.State, st.Event.Type, st.To)
			return nil
		}
	}
	ticket, err := saga.New("ticket",
		saga.Transition{From: "OPEN", Event: "Reserve", To: "HELD", Func: effect(func(st *saga.Step) {
			st.SetTimeout("hold", time.Now().Add(hold))
			st.Data = json.RawMessage(`{"held":true}`)
		})},
		saga.Transition{From: "OPEN", Event: "Cancel", To: "CANCELLED", Func: effect(nil)},
		saga.Transition{From: "HELD", Event: "Pay", To: "PAID", Func: effect(func(st *saga.Step) { st.CancelTimeout("hold") })},
		saga.Transition{From: "HELD", Event: saga.TimeoutEvent("hold"), To: "EXPIRED", Func: effect(nil)},
	)
	if err != nil {
		t.Fatal(err)
	}
	return &env{db: db, ticket: ticket, hold: hold}
}

func (e *env) start(t *testing.T, id string) {
	t.Helper()
	e.inTx(t, func(ctx context.Context, tx pgx.Tx) error { return e.ticket.Start(ctx, tx, id, "OPEN", nil) })
}

func (e *env) apply(t *testing.T, id, event string) saga.Result {
	t.Helper()
	var res saga.Result
	e.inTx(t, func(ctx context.Context, tx pgx.Tx) (err error) {
		res, err = e.ticket.Apply(ctx, tx, id, saga.Event{Type: event, ID: "ev-" + event})
		return err
	})
	return res
}

func (e *env) inTx(t *testing.T, fn func(context.Context, pgx.Tx) error) {
	t.Helper()
	if err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
		return fn(context.Background(), tx)
	}); err != nil {
		t.Fatal(err)
	}
}

func (e *env) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	if err := e.db.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (e *env) wantState(t *testing.T, id, state string, version int64) {
	t.Helper()
	in, err := saga.Load(context.Background(), e.db.Pool, id)
	if err != nil {
		t.Fatal(err)
	}
	if in.State != state || in.Version != version {
		t.Fatalf("instance %s: state %s version %d, want %s version %d", id, in.State, in.Version, state, version)
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func runScanner(t *testing.T, pool *pgxpool.Pool, sg *saga.Saga) *saga.Scanner {
	t.Helper()
	sc, err := saga.NewScanner(pool, saga.ScannerConfig{PollInterval: 10 * time.Millisecond}, sg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return sc
}

func TestEveryTransition(t *testing.T) {
	t.Parallel()
	e := setup(t, time.Hour)
	e.start(t, "a")
	e.start(t, "b")
	e.wantState(t, "a", "OPEN", 1)

	if res := e.apply(t, "a", "Reserve"); !res.Applied || res.From != "OPEN" || res.To != "HELD" || res.Version != 2 {
		t.Fatalf("Reserve: %+v", res)
	}
	e.wantState(t, "a", "HELD", 2)
	if in, _ := saga.Load(context.Background(), e.db.Pool, "a"); string(in.Data) != `{"held": true}` {
		t.Fatalf("data %s, want the func's", in.Data)
	}
	if n := e.count(t, `SELECT count(*) FROM saga_timeouts WHERE saga_id = 'a' AND name = 'hold'`); n != 1 {
		t.Fatalf("%d hold timeouts, want 1", n)
	}
	e.apply(t, "a", "Pay")
	e.wantState(t, "a", "PAID", 3)
	if n := e.count(t, `SELECT count(*) FROM saga_timeouts`); n != 0 {
		t.Fatalf("%d timeouts after Pay, want the hold cancelled", n)
	}
	e.apply(t, "b", "Cancel")
	e.wantState(t, "b", "CANCELLED", 2)

	if n := e.count(t, `SELECT count(*) FROM effects`); n != 3 {
		t.Fatalf("%d effects, want 3", n)
	}
	if n := e.count(t, `SELECT count(*) FROM effects WHERE to_state IN ('HELD', 'PAID', 'CANCELLED')`); n != 3 {
		t.Fatalf("%d effects of the three transitions, want 3", n)
	}
}

func TestStartTwiceFails(t *testing.T) {
	t.Parallel()
	e := setup(t, time.Hour)
	e.start(t, "a")
	err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
		return e.ticket.Start(context.Background(), tx, "a", "OPEN", nil)
	})
	if !errors.Is(err, saga.ErrExists) {
		t.Fatalf("second Start: %v, want ErrExists", err)
	}
}

func TestQueueStart(t *testing.T) {
	t.Parallel()
	e := setup(t, time.Hour)
	ctx := context.Background()
	// The business row and the instance in one batch, as a service starts
	// its saga.
	send := func(id string) error {
		return pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue(`INSERT INTO effects (saga_id, event) VALUES ($1, 'created')`, id)
			if err := e.ticket.QueueStart(ctx, b, id, "OPEN", map[string]bool{"new": true}); err != nil {
				return err
			}
			return tx.SendBatch(ctx, b).Close()
		})
	}

	t.Run("the instance commits with the batch", func(t *testing.T) {
		if err := send("a"); err != nil {
			t.Fatal(err)
		}
		e.wantState(t, "a", "OPEN", 1)
		if in, _ := saga.Load(ctx, e.db.Pool, "a"); string(in.Data) != `{"new": true}` {
			t.Fatalf("data %s, want the given data", in.Data)
		}
	})
	t.Run("a taken id is ErrExists and the batch rolls back", func(t *testing.T) {
		if err := send("a"); !errors.Is(err, saga.ErrExists) {
			t.Fatalf("second start: %v, want ErrExists", err)
		}
		if n := e.count(t, `SELECT count(*) FROM effects WHERE saga_id = 'a'`); n != 1 {
			t.Fatalf("%d business rows, want only the first start's", n)
		}
	})
	t.Run("data that does not encode queues nothing", func(t *testing.T) {
		b := &pgx.Batch{}
		if err := e.ticket.QueueStart(ctx, b, "b", "OPEN", func() {}); err == nil || b.Len() != 0 {
			t.Fatalf("err %v, %d statements queued; want an error and none", err, b.Len())
		}
	})
}

// Timeouts given to Start are armed with the instance: a first state that
// waits for an answer is bounded from the start, and a transition out of it
// cancels the wait like any other timeout.
func TestStartTimeouts(t *testing.T) {
	t.Parallel()
	e := setup(t, time.Hour)
	ctx := context.Background()
	door, err := saga.New("door",
		saga.Transition{From: "AJAR", Event: "Close", To: "SHUT",
			Func: func(_ context.Context, _ pgx.Tx, st *saga.Step) error { st.CancelTimeout("ajar"); return nil }},
		saga.Transition{From: "AJAR", Event: saga.TimeoutEvent("ajar"), To: "SLAMMED"},
	)
	if err != nil {
		t.Fatal(err)
	}
	start := func(id string, due time.Time) {
		t.Helper()
		e.inTx(t, func(ctx context.Context, tx pgx.Tx) error {
			return door.Start(ctx, tx, id, "AJAR", nil, saga.Timeout{Name: "ajar", Due: due})
		})
	}
	past, future := time.Now().Add(-time.Second), time.Now().Add(time.Hour)
	start("due", past)
	start("closed", past)
	e.inTx(t, func(ctx context.Context, tx pgx.Tx) error {
		_, err := door.Apply(ctx, tx, "closed", saga.Event{Type: "Close"})
		return err
	})
	start("later", future)

	sc, err := saga.NewScanner(e.db.Pool, saga.ScannerConfig{}, door)
	if err != nil {
		t.Fatal(err)
	}
	for {
		fired, err := sc.FireOne(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !fired {
			break
		}
	}
	if sc.Fired() != 1 {
		t.Fatalf("%d timeouts fired, want the one still due", sc.Fired())
	}
	e.wantState(t, "due", "SLAMMED", 2)
	e.wantState(t, "closed", "SHUT", 2)
	e.wantState(t, "later", "AJAR", 1)
	if n := e.count(t, `SELECT count(*) FROM saga_timeouts WHERE saga_id = 'later' AND name = 'ajar'`); n != 1 {
		t.Fatal("the later instance lost its start timeout")
	}

	t.Run("a timeout without a name queues nothing", func(t *testing.T) {
		b := &pgx.Batch{}
		if err := door.QueueStart(t.Context(), b, "x", "AJAR", nil, saga.Timeout{Due: future}); err == nil || b.Len() != 0 {
			t.Fatalf("err %v, %d statements queued; want an error and none", err, b.Len())
		}
	})
}

func TestQueuedWritesGoWithTheTransition(t *testing.T) {
	t.Parallel()
	db := newSchema(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE effects (saga_id text, what text)`); err != nil {
		t.Fatal(err)
	}
	// E writes an effect and reads through tx, which does not see it yet;
	// F queues a write that fails.
	var seen int
	sg, err := saga.New("x",
		saga.Transition{From: "A", Event: "E", To: "B", Func: func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
			st.Batch().Queue(`INSERT INTO effects (saga_id, what) VALUES ($1, 'E')`, st.Instance.ID)
			return tx.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&seen)
		}},
		saga.Transition{From: "A", Event: "F", To: "B", Func: func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
			st.Batch().Queue(`INSERT INTO effects (saga_id, what) VALUES ($1, 'F')`, st.Instance.ID)
			st.Batch().Queue(`INSERT INTO no_such_table VALUES (1)`)
			return nil
		}},
	)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"1", "2", "3"} {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return sg.Start(ctx, tx, id, "A", nil) }); err != nil {
			t.Fatal(err)
		}
	}
	apply := func(t *testing.T, id, event string, commit bool) error {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
		if _, err := sg.Apply(ctx, tx, id, saga.Event{Type: event}); err != nil {
			return err
		}
		if !commit {
			return nil
		}
		return tx.Commit(ctx)
	}
	effects := func(t *testing.T, id string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE saga_id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	wantState := func(t *testing.T, id, state string, version int64) {
		t.Helper()
		if in, err := saga.Load(ctx, db.Pool, id); err != nil || in.State != state || in.Version != version {
			t.Fatalf("instance %s: %+v (%v), want %s version %d", id, in, err, state, version)
		}
	}

	t.Run("they commit with the new state, after the func's reads", func(t *testing.T) {
		if err := apply(t, "1", "E", true); err != nil {
			t.Fatal(err)
		}
		wantState(t, "1", "B", 2)
		if effects(t, "1") != 1 || seen != 0 {
			t.Fatalf("%d effects, %d seen by the func; want 1 and 0", effects(t, "1"), seen)
		}
	})
	t.Run("they roll back with the caller's transaction", func(t *testing.T) {
		if err := apply(t, "2", "E", false); err != nil {
			t.Fatal(err)
		}
		wantState(t, "2", "A", 1)
		if n := effects(t, "2"); n != 0 {
			t.Fatalf("%d effects after a rollback, want 0", n)
		}
	})
	t.Run("a failing one fails the transition", func(t *testing.T) {
		if err := apply(t, "3", "F", true); err == nil {
			t.Fatal("Apply succeeded with a failing queued write")
		}
		wantState(t, "3", "A", 1)
		if n := effects(t, "3"); n != 0 {
			t.Fatalf("%d effects after a failed transition, want 0", n)
		}
	})
}

func TestUnexpectedEventIsRecordedAndIgnored(t *testing.T) {
	t.Parallel()
	e := setup(t, time.Hour)
	e.start(t, "a")

	t.Run("event out of order", func(t *testing.T) {
		// Pay before Reserve: no transition from OPEN.
		if res := e.apply(t, "a", "Pay"); res.Applied || res.From != "OPEN" {
			t.Fatalf("Pay in OPEN: %+v, want ignored", res)
		}
		e.wantState(t, "a", "OPEN", 1)
	})
	t.Run("stale event applied twice", func(t *testing.T) {
		// A copy that got past the inbox finds the instance moved on.
		e.apply(t, "a", "Reserve")
		if res := e.apply(t, "a", "Reserve"); res.Applied {
			t.Fatalf("second Reserve applied: %+v", res)
		}
		e.wantState(t, "a", "HELD", 2)
		if n := e.count(t, `SELECT count(*) FROM effects WHERE event = 'Reserve'`); n != 1 {
			t.Fatalf("%d Reserve effects, want 1", n)
		}
	})
	t.Run("unknown instance", func(t *testing.T) {
		if res := e.apply(t, "nobody", "Reserve"); res.Applied || res.From != "" {
			t.Fatalf("event for unknown instance: %+v", res)
		}
	})
	if n := e.count(t, `SELECT count(*) FROM saga_unexpected WHERE saga_id = 'a' AND state IS NOT NULL`); n != 2 {
		t.Fatalf("%d unexpected events of a recorded, want 2", n)
	}
	if n := e.count(t, `SELECT count(*) FROM saga_unexpected WHERE saga_id = 'nobody' AND state IS NULL AND event_id = 'ev-Reserve'`); n != 1 {
		t.Fatalf("%d unexpected events of nobody recorded, want 1", n)
	}
}

func TestFuncErrorRollsBack(t *testing.T) {
	t.Parallel()
	db := newSchema(t)
	boom := errors.New("boom")
	sg, err := saga.New("x", saga.Transition{From: "A", Event: "E", To: "B",
		Func: func(ctx context.Context, tx pgx.Tx, st *saga.Step) error { return boom }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return sg.Start(ctx, tx, "1", "A", nil) }); err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := sg.Apply(ctx, tx, "1", saga.Event{Type: "E"})
		return err
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Apply: %v, want the func's error", err)
	}
	if in, _ := saga.Load(ctx, db.Pool, "1"); in.State != "A" || in.Version != 1 {
		t.Fatalf("after a failed func: %+v", in)
	}
}

func TestTimeoutFires(t *testing.T) {
	t.Parallel()
	e := setup(t, 100*time.Millisecond)
	sc := runScanner(t, e.db.Pool, e.ticket)
	e.start(t, "a")
	e.apply(t, "a", "Reserve")
	eventually(t, "the hold to expire", func() bool {
		in, err := saga.Load(context.Background(), e.db.Pool, "a")
		return err == nil && in.State == "EXPIRED"
	})
	// Counted just after the commit that made the state visible.
	eventually(t, "the timeout to be counted", func() bool { return sc.Fired() == 1 })
	if n := e.count(t, `SELECT count(*) FROM saga_timeouts`); n != 0 {
		t.Fatalf("%d timeouts left after firing", n)
	}
	if n := e.count(t, `SELECT count(*) FROM effects WHERE to_state = 'EXPIRED'`); n != 1 {
		t.Fatalf("%d effects of the expiry, want 1", n)
	}
}

func TestCancelledTimeoutDoesNotFire(t *testing.T) {
	t.Parallel()
	e := setup(t, 50*time.Millisecond)
	e.start(t, "a")
	e.apply(t, "a", "Reserve")
	e.apply(t, "a", "Pay")
	time.Sleep(100 * time.Millisecond) // past the due time the hold had
	sc, err := saga.NewScanner(e.db.Pool, saga.ScannerConfig{}, e.ticket)
	if err != nil {
		t.Fatal(err)
	}
	if fired, err := sc.FireOne(context.Background()); err != nil || fired {
		t.Fatalf("FireOne: fired %v, err %v; want nothing to fire", fired, err)
	}
	e.wantState(t, "a", "PAID", 3)
}

func TestTimeoutDueWhileDownFiresOnNextStart(t *testing.T) {
	t.Parallel()
	// No scanner runs while the hold falls due: the process is down.
	e := setup(t, time.Millisecond)
	e.start(t, "a")
	e.apply(t, "a", "Reserve")
	time.Sleep(20 * time.Millisecond)
	e.wantState(t, "a", "HELD", 2)

	runScanner(t, e.db.Pool, e.ticket) // the restart
	eventually(t, "the overdue hold to fire", func() bool {
		in, err := saga.Load(context.Background(), e.db.Pool, "a")
		return err == nil && in.State == "EXPIRED"
	})
}

func TestTwoScannersFireEachTimeoutOnce(t *testing.T) {
	t.Parallel()
	e := setup(t, 200*time.Millisecond)
	const n = 40
	for i := range n {
		id := fmt.Sprint(i)
		e.start(t, id)
		e.apply(t, id, "Reserve")
	}
	// Two "processes", each with its own pool and scanner.
	runScanner(t, e.db.NewPool(t, 3), e.ticket)
	runScanner(t, e.db.NewPool(t, 3), e.ticket)
	eventually(t, "every hold to fire", func() bool {
		return e.count(t, `SELECT count(*) FROM saga_instances WHERE state = 'EXPIRED'`) == n
	})
	if got := e.count(t, `SELECT count(*) FROM effects WHERE event = 'timeout:hold'`); got != n {
		t.Fatalf("%d timeout effects, want %d (each once)", got, n)
	}
}

func TestFailingTimeoutDoesNotHoldBackOthers(t *testing.T) {
	t.Parallel()
	db := newSchema(t)
	sg, err := saga.New("x", saga.Transition{From: "A", Event: saga.TimeoutEvent("t"), To: "B",
		Func: func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
			if st.Instance.ID == "bad" {
				return errors.New("boom")
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, id := range []string{"bad", "good"} { // bad falls due first
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return sg.Start(ctx, tx, id, "A", nil) }); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Pool.Exec(ctx, `INSERT INTO saga_timeouts (saga_id, name, due_at) VALUES ($1, 't', now() - interval '1s')`, id); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond)
	}
	runScanner(t, db.Pool, sg)
	eventually(t, "the good timeout to fire", func() bool {
		in, err := saga.Load(ctx, db.Pool, "good")
		return err == nil && in.State == "B"
	})
	var later bool
	if err := db.Pool.QueryRow(ctx, `SELECT due_at > now() FROM saga_timeouts WHERE saga_id = 'bad'`).Scan(&later); err != nil || !later {
		t.Fatalf("the failing timeout was not postponed (%v)", err)
	}
}

// Due timeouts fire many to a transaction, in due order, and an instance
// with two due timeouts gets both, the second applied to the state the
// first left; a failing transition rolls the batch back and the others
// still fire, one per transaction, while the failing one is postponed.
func TestTimeoutsFireInBatches(t *testing.T) {
	t.Parallel()
	db := newSchema(t)
	ctx := context.Background()
	sg, err := saga.New("x",
		saga.Transition{From: "A", Event: saga.TimeoutEvent("t"), To: "B",
			Func: func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
				if st.Instance.ID == "bad" {
					return errors.New("boom")
				}
				return nil
			}},
		saga.Transition{From: "B", Event: saga.TimeoutEvent("u"), To: "C"},
	)
	if err != nil {
		t.Fatal(err)
	}
	due := func(id, name string, ago int) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO saga_timeouts (saga_id, name, due_at) VALUES ($1, $2, now() - $3 * interval '1s')`,
			id, name, ago); err != nil {
			t.Fatal(err)
		}
	}
	start := func(id string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return sg.Start(ctx, tx, id, "A", nil) }); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 10 {
		start(fmt.Sprint("i", i))
		due(fmt.Sprint("i", i), "t", 100-i)
	}
	start("twice")
	due("twice", "t", 50)
	due("twice", "u", 40) // due after t: fires on the state t left

	sc, err := saga.NewScanner(db.Pool, saga.ScannerConfig{}, sg)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := sc.Fire(ctx, 64); err != nil || n != 12 {
		t.Fatalf("Fire: %d fired, %v; want all 12 in one transaction", n, err)
	}
	for i := range 10 {
		if in, err := saga.Load(ctx, db.Pool, fmt.Sprint("i", i)); err != nil || in.State != "B" {
			t.Fatalf("i%d: %+v, %v; want state B", i, in, err)
		}
	}
	if in, err := saga.Load(ctx, db.Pool, "twice"); err != nil || in.State != "C" || in.Version != 3 {
		t.Fatalf("twice: %+v, %v; want state C at version 3", in, err)
	}

	t.Run("a failing transition does not take the batch down", func(t *testing.T) {
		start("bad")
		due("bad", "t", 30)
		for i := range 3 {
			start(fmt.Sprint("j", i))
			due(fmt.Sprint("j", i), "t", 20-i)
		}
		if n, err := sc.Fire(ctx, 64); err != nil || n != 3 {
			t.Fatalf("Fire: %d fired, %v; want the 3 good ones, one at a time", n, err)
		}
		for i := range 3 {
			if in, err := saga.Load(ctx, db.Pool, fmt.Sprint("j", i)); err != nil || in.State != "B" {
				t.Fatalf("j%d: %+v, %v; want state B", i, in, err)
			}
		}
		var later bool
		if err := db.Pool.QueryRow(ctx, `SELECT due_at > now() FROM saga_timeouts WHERE saga_id = 'bad'`).Scan(&later); err != nil || !later {
			t.Fatalf("the failing timeout was not postponed (%v)", err)
		}
		if got := sc.Fired(); got != 15 {
			t.Fatalf("Fired() = %d, want 15", got)
		}
	})
}

// newSchema is a test's own schema holding the saga's tables, from this
// package's migrations/ alone.
func newSchema(t testing.TB) *testenv.Schema {
	t.Helper()
	return testenv.New(t, testenv.Migrations{Table: "saga_goose_version", FS: migrations.FS()})
}
