// Package chaos is the chaos run of the shop (`make chaos`): it builds the
// real `shop` binary and nats-server, starts a three-node NATS cluster (or
// one node) and two copies of every service (Config.Copies) as separate
// processes against a throwaway Postgres database, each process reaching
// each node through a fault proxy of the harness's own, drives orders
// through the public HTTP API, and meanwhile SIGKILLs processes, fires
// every failpoint, resets one process's NATS connections, cuts one
// service's database connections, publishes hostile events into ORDERS and
// injects broker faults: a stream leader killed, quorum lost, a shop
// process silently partitioned, JetStream disabled on a node, a durable
// consumer deleted, the whole cluster restarted. The cdc lane (not run by
// default: LANES=cdc) runs every relay in ModeCDC against a private
// Postgres cluster (proof/pgcluster), kills the processes streaming the
// slots, drops slots and restarts that Postgres. Then it restarts
// everything cleanly, waits until every saga has ended, discards what the
// hostile peer left, audits the streams against the outboxes and repairs
// what they lost, checks the contract's invariants with the code of `shop
// verify` and reports what the faults cost (see Result).
//
// The files follow the run: chaos.go (Config, Result, Run), database.go,
// cluster.go and proxy.go (the NATS nodes and the proxies in front of
// them), process.go (the shop processes and their supervisors),
// failpoints.go, client.go and driver.go (the orders), faults.go (the fault
// lanes), cdc.go (the cdc lane), hostile.go, streams.go, and the report:
// report.go, stall.go, redelivery.go, exits.go.
package chaos
