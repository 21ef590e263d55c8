-- Shard ownership (an opt-in relay mode of 00002) is gone from the
-- library: measured, it bought nothing on the machines it was tried on
-- (docs/performance.md), and no relay used it. Its table and its index go;
-- the index was maintained on every outbox insert. outbox_relays stays:
-- every relay says it is alive there (pkg/outbox alive.go). Idempotent.

-- +goose Up
DROP INDEX IF EXISTS outbox_pending_shard;
DROP TABLE IF EXISTS outbox_shards;
