-- The saga's tables, in the schema of the service that runs the saga, so
-- that transitions commit in the same transactions as its business rows.
-- goose format; applied with a version table of the saga's own (the shop:
-- saga_goose_version, see migrations/). Every Up statement is idempotent, so
-- it also applies to a schema that already has the tables.

-- +goose Up

-- One row per saga instance. Apply locks it (FOR UPDATE), so two events of
-- one instance take turns, and bumps version on every transition.
CREATE TABLE IF NOT EXISTS saga_instances (
    id         text        PRIMARY KEY,
    type       text        NOT NULL,
    state      text        NOT NULL,
    version    bigint      NOT NULL DEFAULT 1,
    data       jsonb       NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Durable timeouts: set and cancelled in the transaction of a transition, so
-- they survive restarts; a scanner claims due rows with SKIP LOCKED.
CREATE TABLE IF NOT EXISTS saga_timeouts (
    saga_id text        NOT NULL REFERENCES saga_instances (id) ON DELETE CASCADE,
    name    text        NOT NULL,
    due_at  timestamptz NOT NULL,
    PRIMARY KEY (saga_id, name)
);
CREATE INDEX IF NOT EXISTS saga_timeouts_due ON saga_timeouts (due_at);

-- Events that had no transition from the instance's state (or no instance):
-- recorded for operators and ignored, so they never block a consumer.
CREATE TABLE IF NOT EXISTS saga_unexpected (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    saga_id     text        NOT NULL,
    saga_type   text        NOT NULL,
    state       text,                   -- NULL: no such instance
    event_type  text        NOT NULL,
    event_id    text,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS saga_unexpected_saga ON saga_unexpected (saga_id);

-- +goose Down
DROP TABLE saga_unexpected;
DROP TABLE saga_timeouts;
DROP TABLE saga_instances;
