-- The inbox's tables. goose format; applied with a version table of the
-- inbox's own (the shop: inbox_goose_version, see migrations/). Every
-- statement is idempotent, so it also applies to a schema that already has
-- the tables (created by an earlier layout of these migrations, or by hand).

-- +goose Up

-- processed_events: the inbox. A consumer inserts (consumer_name, event_id) in
-- the same transaction as the effect of the event; a redelivered event finds
-- the row and changes nothing.
CREATE TABLE IF NOT EXISTS processed_events (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX IF NOT EXISTS processed_events_age ON processed_events (processed_at);

-- The last sequence each consumer applied per producer and aggregate: an
-- older sequence is a duplicate, a later one than next is a gap to wait out.
CREATE TABLE IF NOT EXISTS inbox_sequences (
    consumer_name  text        NOT NULL,
    source         text        NOT NULL,   -- the producer: first token of the subject
    aggregate_type text        NOT NULL,   -- '' when the producer does not send Aggregate-Type
    aggregate_id   text        NOT NULL,
    last_seq       bigint      NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, source, aggregate_type, aggregate_id)
);

-- Failures of a handler so far, so a dead letter can tell when it first failed.
CREATE TABLE IF NOT EXISTS inbox_failures (
    consumer_name   text        NOT NULL,
    event_id        uuid        NOT NULL,
    attempts        integer     NOT NULL,
    first_failed_at timestamptz NOT NULL,
    last_failed_at  timestamptz NOT NULL,
    last_error      text        NOT NULL,
    PRIMARY KEY (consumer_name, event_id)
);

-- dead_letters: messages a consumer could not process. Kept until an operator
-- requeues them; never deleted by retention.
CREATE TABLE IF NOT EXISTS dead_letters (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_name   text        NOT NULL,
    stream          text        NOT NULL,
    stream_seq      bigint      NOT NULL,
    subject         text        NOT NULL,
    headers         jsonb       NOT NULL,
    payload         bytea       NOT NULL,
    event_id        uuid,                  -- NULL when the message could not be decoded
    error           text        NOT NULL,
    attempts        integer     NOT NULL,
    first_failed_at timestamptz NOT NULL,
    last_failed_at  timestamptz NOT NULL,
    requeued_at     timestamptz,           -- an operator asked for another try
    resolved_at     timestamptz,           -- the retry succeeded
    UNIQUE (consumer_name, stream, stream_seq)
);
CREATE INDEX IF NOT EXISTS dead_letters_open ON dead_letters (consumer_name, id) WHERE resolved_at IS NULL;
