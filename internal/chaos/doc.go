// Package chaos is the chaos run of the shop (`make chaos`): it builds the
// real `shop` binary and nats-server, starts a three-node NATS cluster (or
// one node) and two copies of every service as separate processes against
// a throwaway Postgres database, each process reaching each node through a
// fault proxy of the harness's own, drives orders through the public HTTP
// API, and meanwhile SIGKILLs processes, fires every failpoint, cuts one
// service's database connections and injects broker faults: a stream
// leader killed, quorum lost, a shop process silently partitioned,
// JetStream disabled on a node, a durable consumer deleted, the whole
// cluster restarted. Then it restarts everything cleanly, waits until every
// saga has ended, checks the contract's invariants with the code of `shop
// verify` and reports what the faults cost (see Result).
package chaos
