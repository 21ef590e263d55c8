//go:build shopbench

// Package benchsuite is the whole-system benchmark of the shop (`make
// bench`): BenchmarkSystem measures, in one run and on the same machine, the
// ceilings (JetStream publishing, the order-creation SQL run directly, the
// relay's database work alone) and each part of the system against them —
// the relay, the write path, latency at a steady rate, POST /orders over
// HTTP (to the order service alone, beside its SQL sent directly, and to
// `shop all`), the whole saga through a real `shop all` process, cost growth with
// large tables, the peak memory of `shop all`, and what durability costs
// (the relay and the saga with and without NATS's fsync before every ack,
// the stream audit of `shop verify`), and the relay's two modes side by
// side, ModeCDC and ModePoll interleaved in the same run (row 11: a 50k
// drain beside each mode's database-only ceiling, with Postgres CPU and
// transactions per published event; row 12: commit → consumer commit at
// 500 events/s; row 13: the whole saga with RELAY_MODE=cdc and =poll) —
// and prints one table in
// which every row is the median, minimum and maximum of several runs. Beside
// the rows whose bound is in question it prints how busy the machine's CPU
// was meanwhile: a row at ~100 % is bound by CPU, not by waiting.
//
// It is a benchmark only: `go test ./...` runs none of it (only a test of
// its CPU arithmetic). Nothing in it asserts on time; it prints figures. See
// docs/performance.md.
package benchsuite
