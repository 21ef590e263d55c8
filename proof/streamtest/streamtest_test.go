package streamtest

import (
	"math/rand/v2"
	"slices"
	"testing"
)

func TestInterleaveKeepsEachQueuesOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	queues := [][]int{{10, 11, 12}, {20, 21}, {30}, {40, 41, 42, 43}}
	var all []int
	for _, q := range queues {
		all = append(all, q...)
	}
	stream := Interleave(rng, slices.Clone(queues))
	if got := slices.Sorted(slices.Values(stream)); !slices.Equal(got, all) {
		t.Fatalf("stream %v does not hold each event once (want %v)", stream, all)
	}
	for _, q := range queues {
		last := -1
		for _, x := range q {
			i := slices.Index(stream, x)
			if i < last {
				t.Fatalf("stream %v: %d comes before an earlier event of its queue %v", stream, x, q)
			}
			last = i
		}
	}
	if slices.Equal(stream, all) {
		t.Fatalf("stream %v is the queues one after another, not interleaved", stream)
	}
}

func TestBatchesCutInOrder(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	s := make([]int, 100)
	for i := range s {
		s[i] = i
	}
	var joined []int
	for _, b := range Batches(t, rng, s, 7) {
		if len(b) < 1 || len(b) > 7 {
			t.Fatalf("a batch of %d, want 1 to 7", len(b))
		}
		joined = append(joined, b...)
	}
	if !slices.Equal(joined, s) {
		t.Fatalf("the batches joined are %v, want %v", joined, s)
	}
}
