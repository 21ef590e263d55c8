package saga_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/saga"
)

// countingTicket is the test saga with funcs that read: each stores, in
// the instance's data, how many effects its instance has so far, which
// the transitions before it (in the same batch too) have written.
func countingTicket(t *testing.T) *saga.Saga {
	t.Helper()
	effect := func(extra func(st *saga.Step)) saga.TransitionFunc {
		return func(ctx context.Context, tx pgx.Tx, st *saga.Step) error {
			var n int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM effects WHERE saga_id = $1`, st.Instance.ID).Scan(&n); err != nil {
				return err
			}
			st.Data = fmt.Appendf(nil, `{"effects_before":%d,"version_before":%d}`, n, st.Instance.Version)
			if extra != nil {
				extra(st)
			}
			st.Batch().Queue(`INSERT INTO effects (saga_id, from_state, event) VALUES ($1, $2, $3)`,
				st.Instance.ID, st.Instance.State, st.Event.Type)
			return nil
		}
	}
	ticket, err := saga.New("ticket",
		saga.Transition{From: "OPEN", Event: "Reserve", To: "HELD", Func: effect(func(st *saga.Step) {
			st.SetTimeout("hold", time.Now().Add(time.Hour))
		})},
		saga.Transition{From: "OPEN", Event: "Cancel", To: "CANCELLED", Func: effect(nil)},
		saga.Transition{From: "HELD", Event: "Pay", To: "PAID", Func: effect(func(st *saga.Step) { st.CancelTimeout("hold") })},
		saga.Transition{From: "HELD", Event: "Touch", To: "HELD", Func: effect(nil)},
		saga.Transition{From: "HELD", Event: saga.TimeoutEvent("hold"), To: "EXPIRED", Func: effect(nil)},
	)
	if err != nil {
		t.Fatal(err)
	}
	return ticket
}

// The size of a batch changes nothing: ApplyBatch carries each instance's
// new state from one event to the next in memory and sends the writes
// queued so far before an instance's second func runs, which must leave
// what a batch of one (Apply) leaves. Random streams of events (expected,
// unexpected, for instances that do not exist, several for one instance in
// one batch), applied one per transaction on one schema and in batches of
// random sizes on another, give the same results, instances, timeouts,
// unexpected records and func writes.
func TestBatchSizeChangesNoTransition(t *testing.T) {
	t.Parallel()
	seeds(t, 4, func(t *testing.T, rng *rand.Rand) {
		alone, batched := setup(t, time.Hour), setup(t, time.Hour)
		ticket := countingTicket(t)
		for _, e := range []*env{alone, batched} {
			for i := range 12 {
				e.start(t, fmt.Sprint("t-", i))
			}
		}
		types := []string{"Reserve", "Reserve", "Cancel", "Pay", "Pay", "Touch", "Touch", saga.TimeoutEvent("hold"), "Bogus"}
		events := make([]saga.BatchEvent, 150)
		for i := range events {
			typ := types[rng.IntN(len(types))]
			events[i] = saga.BatchEvent{Ctx: context.Background(), ID: fmt.Sprint("t-", rng.IntN(14)), // t-12, t-13 do not exist
				Event: saga.Event{Type: typ, ID: fmt.Sprint("ev-", i)}}
		}
		var want, got []string
		for _, ev := range events {
			alone.inTx(t, func(ctx context.Context, tx pgx.Tx) error {
				res, err := ticket.Apply(ctx, tx, ev.ID, ev.Event)
				want = append(want, fmt.Sprintf("%+v", res))
				return err
			})
		}
		for _, batch := range batches(t, rng, events, 30) {
			batched.inTx(t, func(ctx context.Context, tx pgx.Tx) error {
				res, err := ticket.ApplyBatch(ctx, tx, batch)
				for _, r := range res {
					got = append(got, fmt.Sprintf("%+v", r))
				}
				return err
			})
		}
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Errorf("results differ:\n--- Apply in turn\n%s\n--- ApplyBatch\n%s", strings.Join(want, "\n"), strings.Join(got, "\n"))
		}
		a, b := alone.sagaSnapshot(t), batched.sagaSnapshot(t)
		if a != b {
			t.Errorf("the tables differ:\n--- Apply in turn\n%s\n--- ApplyBatch\n%s", a, b)
		}
		for _, s := range []string{"PAID", "CANCELLED", "hold", "Bogus", "t-13"} {
			if !strings.Contains(a, s) {
				t.Errorf("the stream never reached %s", s)
			}
		}
		if !regexp.MustCompile(`"effects_before": [1-9]`).MatchString(a) {
			t.Error("no func read an effect of its instance's earlier transition; the test proves nothing")
		}
	})
}

// sagaSnapshot is the saga's tables and the funcs' effects as text
// (timestamps left out).
func (e *env) sagaSnapshot(t *testing.T) string {
	t.Helper()
	return e.db.Dump(t,
		`SELECT id, state, version, data::text FROM saga_instances ORDER BY id`,
		`SELECT saga_id, name FROM saga_timeouts ORDER BY saga_id, name`,
		`SELECT saga_id, coalesce(state, '-'), event_type, event_id FROM saga_unexpected ORDER BY event_id`,
		`SELECT saga_id, from_state, event FROM effects ORDER BY saga_id, at`)
}

// seeds runs f as n parallel subtests, seed-1 … seed-n, each with a rand
// seeded by its number, so that a failure names the seed that reproduces it.
func seeds(t *testing.T, n int, f func(t *testing.T, rng *rand.Rand)) {
	t.Helper()
	for run := range n {
		seed := uint64(run + 1)
		t.Run(fmt.Sprint("seed-", seed), func(t *testing.T) {
			t.Parallel()
			f(t, rand.New(rand.NewPCG(seed, seed)))
		})
	}
}

// batches cuts s, in order, into batches of 1 to most elements. It fails t
// when no batch holds two: the batch path fed batches of one would prove
// nothing.
func batches[T any](t testing.TB, rng *rand.Rand, s []T, most int) [][]T {
	t.Helper()
	var out [][]T
	widest := 0
	for rest := s; len(rest) > 0; {
		n := min(len(rest), 1+rng.IntN(most))
		out = append(out, rest[:n])
		widest = max(widest, n)
		rest = rest[n:]
	}
	if widest < 2 {
		t.Fatal("no batch had two events; the test proves nothing")
	}
	return out
}
