//go:build shopbench

// Package benchsuite is the whole-system benchmark of the shop (`make
// bench`): BenchmarkSystem measures, in one run and on the same machine, the
// ceilings (JetStream publishing, the order-creation SQL run directly, the
// relay's database work alone) and each part of the system against them —
// the relay, the write path, latency at a steady rate, POST /orders over
// HTTP, the whole saga through a real `shop all` process, cost growth with
// large tables and the peak memory of `shop all` — and prints one table in
// which every row is the median, minimum and maximum of several runs.
//
// It is a benchmark only: `go test ./...` runs none of it. Nothing in it
// asserts on time; it prints figures. See docs/performance.md.
package benchsuite
