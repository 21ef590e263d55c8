-- The outbox's tables. goose format; applied with a version table of the
-- outbox's own (the shop: outbox_goose_version, see migrations/). Every
-- statement is idempotent, so it also applies to a schema that already has
-- the tables (created by an earlier layout of these migrations, or by hand).

-- +goose Up

-- outbox: durable event intents. A row is written in the same transaction as
-- the business change it describes (Writer.Add, Writer.Queue), so both commit
-- or neither does. The relay publishes it and sets published_at only after
-- JetStream's PubAck.
CREATE TABLE IF NOT EXISTS outbox (
    event_id       uuid        PRIMARY KEY,          -- UUIDv7: stable across retries, roughly time-ordered
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    aggregate_seq  bigint      NOT NULL,             -- 1, 2, 3 … per aggregate, gap-free
    event_type     text        NOT NULL,
    schema_version integer     NOT NULL,
    subject        text        NOT NULL,
    payload        json        NOT NULL,             -- immutable snapshot, kept byte for byte (json, not jsonb)
    headers        jsonb       NOT NULL DEFAULT '{}',-- trace context and other metadata
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    available_at   timestamptz NOT NULL DEFAULT now(),-- not before: backoff after a failure
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    claimed_by     text,                             -- relay that holds the lease
    claim_token    uuid,                             -- fences stale relays off
    claim_until    timestamptz,                      -- lease end; after it, anyone may claim
    published_at   timestamptz,                      -- set only after the broker's ack
    dead_at        timestamptz,                      -- set on a deterministic error or too many attempts
    UNIQUE (aggregate_type, aggregate_id, aggregate_seq)
) WITH (fillfactor = 80); -- room on each page so claim updates can stay HOT

-- The relay's work queue: small, because published and dead rows leave it.
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (event_id)
    WHERE published_at IS NULL AND dead_at IS NULL;

-- Retention deletes published rows oldest first.
CREATE INDEX IF NOT EXISTS outbox_published ON outbox (published_at)
    WHERE published_at IS NOT NULL;

-- Dead rows are few; operators list them.
CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (dead_at)
    WHERE dead_at IS NOT NULL;

-- One counter row per aggregate. Incrementing it takes the row lock, which
-- serializes concurrent transactions on one aggregate; a rollback undoes the
-- increment, so sequences have no gaps.
CREATE TABLE IF NOT EXISTS outbox_sequences (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);
