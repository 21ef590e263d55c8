-- The eventing tables every service schema carries. This file is applied as
-- migration version 1 of each service (see migrations.go), so the four schemas
-- share one definition instead of four hand-copied ones. Service-specific
-- migrations in migrations/<service>/ start at version 2.

-- outbox: durable event intents. A row is written in the same transaction as
-- the business change it describes (pkg/outbox.Add), so both commit or neither
-- does. The relay publishes it and sets published_at only after JetStream's
-- PubAck.
CREATE TABLE outbox (
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
CREATE INDEX outbox_pending ON outbox (event_id)
    WHERE published_at IS NULL AND dead_at IS NULL;

-- Retention deletes published rows oldest first.
CREATE INDEX outbox_published ON outbox (published_at)
    WHERE published_at IS NOT NULL;

-- Dead rows are few; operators list them.
CREATE INDEX outbox_dead ON outbox (dead_at)
    WHERE dead_at IS NOT NULL;

-- One counter row per aggregate. Incrementing it takes the row lock, which
-- serializes concurrent transactions on one aggregate; a rollback undoes the
-- increment, so sequences have no gaps.
CREATE TABLE outbox_sequences (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- processed_events: the inbox. A consumer inserts (consumer_name, event_id) in
-- the same transaction as the effect of the event; a redelivered event finds
-- the row and changes nothing.
CREATE TABLE processed_events (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX processed_events_age ON processed_events (processed_at);

-- The last sequence each consumer applied per producer and aggregate: an
-- older sequence is a duplicate, a later one than next is a gap to wait out.
CREATE TABLE inbox_sequences (
    consumer_name  text        NOT NULL,
    source         text        NOT NULL,   -- the producer: first token of the subject
    aggregate_type text        NOT NULL,   -- '' when the producer does not send Aggregate-Type
    aggregate_id   text        NOT NULL,
    last_seq       bigint      NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, source, aggregate_type, aggregate_id)
);

-- Failures of a handler so far, so a dead letter can tell when it first failed.
CREATE TABLE inbox_failures (
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
CREATE TABLE dead_letters (
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
CREATE INDEX dead_letters_open ON dead_letters (consumer_name, id) WHERE resolved_at IS NULL;
