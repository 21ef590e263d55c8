package outbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// shardConfig is a relay in shard mode whose leases a test can outlast.
func shardConfig(name string) Config {
	return Config{Name: name, ShardOwnership: true, LeaseDuration: 600 * time.Millisecond, PublishTimeout: 200 * time.Millisecond,
		PollInterval: 20 * time.Millisecond, BackoffBase: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond}
}

// expire ends every lease of member m and its heartbeat, as if it had
// paused (a GC pause, a hung host) past its lease.
func expire(t *testing.T, e *env, m *member) {
	t.Helper()
	ctx := context.Background()
	if _, err := e.db.Pool.Exec(ctx, `UPDATE outbox_shards SET lease_until = now() - interval '1 second' WHERE owner = $1`, m.name); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Pool.Exec(ctx, `UPDATE outbox_relays SET alive_until = now() - interval '1 second' WHERE name = $1`, m.name); err != nil {
		t.Fatal(err)
	}
}

func TestShardOwnerAfterTakeoverIsFencedOff(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"))
	ctx := context.Background()

	stale := e.relay(t, shardConfig("stale"))
	sm := newMember("stale", 0)
	batch, staleFence, err := stale.take(ctx, sm)
	if err != nil || len(batch) != 1 || len(sm.shards) != shardCount {
		t.Fatalf("the only relay read %d events (%v) and owns %d shards; want 1 and all %d", len(batch), err, len(sm.shards), shardCount)
	}
	expire(t, e, sm)

	freshCfg := shardConfig("fresh")
	freshCfg.LeaseDuration = time.Minute // holds while the stale owner looks again
	fresh := e.relay(t, freshCfg)
	fm := newMember("fresh", 0)
	again, freshFence, err := fresh.take(ctx, fm)
	if err != nil || len(again) != 1 {
		t.Fatalf("the fresh relay could not take the expired shards over: %v, %d events", err, len(again))
	}
	if got := fresh.Counters().TakenOver; got != shardCount {
		t.Errorf("fresh relay counted %d shards taken over, want %d", got, shardCount)
	}

	// The stale owner wakes: its mark and its failure update are refused.
	if err := stale.settle(ctx, staleFence, batch, []result{{}}); err != nil {
		t.Fatal(err)
	}
	if err := stale.settle(ctx, staleFence, batch, []result{{err: errors.New("boom"), permanent: true}}); err != nil {
		t.Fatal(err)
	}
	rec, err := Get(ctx, e.db.Pool, batch[0].id)
	if err != nil {
		t.Fatal(err)
	}
	if rec.PublishedAt != nil || rec.DeadAt != nil || rec.Attempts != 0 {
		t.Fatalf("the stale owner changed an event of a shard it no longer owns: %+v", rec)
	}
	if got := stale.Counters(); got.LostLeases != 2 || got.Published != 0 {
		t.Fatalf("stale owner: %+v, want 2 lost leases and nothing published", got)
	}

	// It renews, finds its shards gone and takes none while the new owner's
	// leases hold: it reads nothing, so the two never publish one shard side by side.
	sm.renewed = time.Time{}
	if batch, _, err := stale.take(ctx, sm); err != nil || len(batch) != 0 || len(sm.shards) != 0 {
		t.Fatalf("after the takeover the stale owner read %d events (%v) and holds shards %v", len(batch), err, sm.shards)
	}

	if err := fresh.settle(ctx, freshFence, again, []result{{}}); err != nil {
		t.Fatal(err)
	}
	if n := count(t, e.db.Pool, "published_at IS NOT NULL"); n != 1 {
		t.Fatal("the new owner could not mark its event")
	}
}

func TestLiveRelaysSplitTheShards(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	r := e.relay(t, shardConfig("r"))
	a, b := newMember("r", 0), newMember("r", 1)
	if err := r.own(ctx, a); err != nil || len(a.shards) != shardCount {
		t.Fatalf("the first member owns %d shards (%v), want all %d", len(a.shards), err, shardCount)
	}
	// b arrives: it finds nothing free until a gives back its surplus at
	// its next round, and then takes it.
	for range 2 {
		for _, m := range []*member{b, a} {
			m.renewed = time.Time{}
			if err := r.own(ctx, m); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(a.shards) != shardCount/2 || len(b.shards) != shardCount/2 {
		t.Fatalf("members own %d and %d shards, want %d each", len(a.shards), len(b.shards), shardCount/2)
	}
	all := slices.Concat(a.shards, b.shards)
	slices.Sort(all)
	if len(slices.Compact(all)) != shardCount {
		t.Fatalf("the members' shards overlap or miss some: %v and %v", a.shards, b.shards)
	}
	// a stops: its shards are free at once, and b takes them all.
	r.leave(ctx, a)
	b.renewed = time.Time{}
	if err := r.own(ctx, b); err != nil || len(b.shards) != shardCount {
		t.Fatalf("after the other left, the member owns %d shards (%v), want %d", len(b.shards), err, shardCount)
	}
}

func TestDeadRelaysShardsAreTakenOver(t *testing.T) {
	e := setup(t)
	var w Writer
	for i := range 20 {
		add(t, e.db.Pool, &w, event(fmt.Sprint("o-", i), "OrderCreated"))
	}
	ctx := context.Background()
	// A relay took every shard and died: nothing gives them back, they
	// move when the lease ends.
	dead := e.relay(t, shardConfig("dead"))
	if err := dead.own(ctx, newMember("dead", 0)); err != nil {
		t.Fatal(err)
	}
	survivor := e.relay(t, shardConfig("survivor"))
	start(t, survivor)
	eventually(t, 10*time.Second, "the dead relay's events published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 20, nil
	})
	if got := survivor.Counters().TakenOver; got != shardCount {
		t.Errorf("survivor took over %d shards, want %d", got, shardCount)
	}
	if got := streamMsgs(t, e.stream); got != 20 {
		t.Errorf("stream holds %d messages, want 20", got)
	}
}

func TestShardOwnersKeepEachAggregatesOrderAcrossARebalance(t *testing.T) {
	e := setup(t)
	var w Writer
	const aggregates, each = 40, 15
	for seq := range each {
		var evs []Event
		for a := range aggregates {
			evs = append(evs, event(fmt.Sprint("o-", a), "Step"+strconv.Itoa(seq+1)))
		}
		add(t, e.db.Pool, &w, evs...)
	}
	total := aggregates * each
	cfg := func(name string) Config {
		c := shardConfig(name)
		c.BatchSize = 7 // many small batches, so that the rebalance falls in the middle
		return c
	}
	// The first relay takes its time over each batch (25 ms): alone on an
	// idle machine it published the whole backlog before the second had
	// its share of the shards, and the test waited for the second in vain.
	slow := cfg("first")
	slow.Hooks.FailpointFunc = func(name string) error {
		if name == FailpointAfterClaim {
			time.Sleep(25 * time.Millisecond)
		}
		return nil
	}
	first := e.relay(t, slow)
	ctx, stopFirst := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	eventually(t, 20*time.Second, "a first part published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") >= total/5, nil
	})
	second := e.relay(t, cfg("second")) // joins: the shards are split
	start(t, second)
	eventually(t, 20*time.Second, "the second relay publishing", func() (bool, error) {
		return second.Counters().Published > 0, nil
	})
	stopFirst() // leaves: its shards move to the second
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == total, nil
	})

	checkFirstCopiesInOrder(t, e, aggregates, each)
}

// checkFirstCopiesInOrder reads the stream: in stream order, each
// aggregate's events come 1, 2, 3 … up to each. A copy of an earlier event
// may follow (the inbox drops it); a later one never comes before an
// earlier one.
func checkFirstCopiesInOrder(t *testing.T, e *env, aggregates int, each int64) {
	t.Helper()
	total := aggregates * int(each)
	cons, err := e.stream.OrderedConsumer(context.Background(), jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	n := streamMsgs(t, e.stream)
	if n < uint64(total) {
		t.Fatalf("stream holds %d messages, want at least %d", n, total)
	}
	high := map[string]int64{}
	for range n {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		agg := m.Headers().Get("Aggregate-Id")
		seq, _ := strconv.ParseInt(m.Headers().Get("Aggregate-Seq"), 10, 64)
		switch {
		case seq == high[agg]+1:
			high[agg] = seq
		case seq > high[agg]+1:
			t.Fatalf("aggregate %s: seq %d published before %d", agg, seq, high[agg]+1)
		}
	}
	for a := range aggregates {
		if got := high[fmt.Sprint("o-", a)]; got != each {
			t.Errorf("aggregate o-%d: published up to %d, want %d", a, got, each)
		}
	}
}

// TestShardOwnersUnderChurnKeepOrder runs three shard-owning relays with
// leases so short that shards change hands while batches are in flight
// (the scheduler of a busy test machine pauses workers past them): whatever
// the interleaving, every event is published and each aggregate's events
// come in sequence, because marks are fenced and every owner reads the
// oldest unpublished events.
func TestShardOwnersUnderChurnKeepOrder(t *testing.T) {
	e := setup(t)
	var w Writer
	const aggregates, each = 30, 10
	for seq := range each {
		var evs []Event
		for a := range aggregates {
			evs = append(evs, event(fmt.Sprint("o-", a), "Step"+strconv.Itoa(seq+1)))
		}
		add(t, e.db.Pool, &w, evs...)
	}
	var relays []*Relay
	for i := range 3 {
		c := shardConfig(fmt.Sprint("churn-", i))
		c.LeaseDuration, c.PublishTimeout, c.BatchSize = 60*time.Millisecond, 30*time.Millisecond, 5
		r := e.relay(t, c)
		relays = append(relays, r)
		start(t, r)
	}
	eventually(t, 60*time.Second, "every event published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == aggregates*each, nil
	})
	var taken, lost int64
	for _, r := range relays {
		taken, lost = taken+r.Counters().TakenOver, lost+r.Counters().LostLeases
	}
	t.Logf("shards taken over from expired owners: %d; marks refused: %d", taken, lost)
	checkFirstCopiesInOrder(t, e, aggregates, each)
}
