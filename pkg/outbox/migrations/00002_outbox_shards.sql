-- Shard ownership (an opt-in relay mode, removed since: 00003 drops what it made but outbox_relays): relays lease hash shards of the
-- aggregates instead of writing a claim on every row. Idempotent, like
-- 00001: it also applies to a schema that already has the tables.

-- +goose Up

-- outbox_shards: one row per shard, 32 of them. The owner reads the
-- shard's events and marks them; epoch goes up on every change of owner,
-- and every mark and failure update names the epoch it was read under, so
-- a stale owner changes nothing. lease_until: after it, any relay may take
-- the shard over.
CREATE TABLE IF NOT EXISTS outbox_shards (
    shard       integer     PRIMARY KEY CHECK (shard >= 0 AND shard < 32),
    owner       text,
    epoch       bigint      NOT NULL DEFAULT 0,
    lease_until timestamptz
);
INSERT INTO outbox_shards (shard) SELECT s FROM generate_series(0, 31) AS s
ON CONFLICT (shard) DO NOTHING;

-- outbox_relays: the members that share the shards (one per relay
-- worker), so that each can take its fair share.
CREATE TABLE IF NOT EXISTS outbox_relays (
    name        text        PRIMARY KEY,
    alive_until timestamptz NOT NULL
);

-- An event's shard is a hash of its aggregate, so all of an aggregate's
-- events have one owner. The expression must be the relay's, character for
-- character (pkg/outbox shard.go, shardExpr), for the planner to use it.
CREATE INDEX IF NOT EXISTS outbox_pending_shard
    ON outbox ((hashtext(aggregate_type || '/' || aggregate_id) & 31), event_id)
    WHERE published_at IS NULL AND dead_at IS NULL;
