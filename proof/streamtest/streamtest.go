// Package streamtest makes the random histories of the tests that hold a
// batch path to its one-at-a-time path (inventory, payment, the saga): a
// stream in which every aggregate's events keep their order while the
// aggregates interleave at random, and cuts of one stream into batches of
// random sizes. Each run is seeded, so a failure names the seed that
// reproduces it.
package streamtest

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// Seeds runs f as n parallel subtests, seed-1 … seed-n, each with a rand
// seeded by its number.
func Seeds(t *testing.T, n int, f func(t *testing.T, rng *rand.Rand)) {
	t.Helper()
	for run := range n {
		seed := uint64(run + 1)
		t.Run(fmt.Sprint("seed-", seed), func(t *testing.T) {
			t.Parallel()
			f(t, rand.New(rand.NewPCG(seed, seed)))
		})
	}
}

// Interleave merges queues into one stream, taking at each step the head
// of a queue picked at random: what a stream of many aggregates looks
// like, each aggregate in order. It consumes queues.
func Interleave[T any](rng *rand.Rand, queues [][]T) []T {
	var stream []T
	for len(queues) > 0 {
		i := rng.IntN(len(queues))
		stream = append(stream, queues[i][0])
		if queues[i] = queues[i][1:]; len(queues[i]) == 0 {
			queues = slices.Delete(queues, i, i+1)
		}
	}
	return stream
}

// Batches cuts s, in order, into batches of 1 to most elements. It fails t
// when no batch holds two: a batch path fed batches of one is the
// one-at-a-time path, and a test of it would prove nothing.
func Batches[T any](t testing.TB, rng *rand.Rand, s []T, most int) [][]T {
	t.Helper()
	var batches [][]T
	widest := 0
	for rest := s; len(rest) > 0; {
		n := min(len(rest), 1+rng.IntN(most))
		batches = append(batches, rest[:n])
		widest = max(widest, n)
		rest = rest[n:]
	}
	if widest < 2 {
		t.Fatal("no batch had two events; the test proves nothing")
	}
	return batches
}
