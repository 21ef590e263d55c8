-- What the inbox needs to keep order per aggregate without holding the
-- broker's capacity, to tell a duplicate from a conflict, and to let an
-- operator discard with a reason. Idempotent, like 00001.

-- +goose Up

-- processed_events also remembers which sequence of which aggregate it
-- applied, so that another event at an applied sequence is recognised as a
-- conflict instead of being taken for a duplicate (classify, steps.go).
-- NULL for consumers without the sequence check and in rows written before
-- this version.
ALTER TABLE processed_events
    ADD COLUMN IF NOT EXISTS source         text,
    ADD COLUMN IF NOT EXISTS aggregate_type text,
    ADD COLUMN IF NOT EXISTS aggregate_id   text,
    ADD COLUMN IF NOT EXISTS aggregate_seq  bigint;
CREATE UNIQUE INDEX IF NOT EXISTS processed_events_seq
    ON processed_events (consumer_name, source, aggregate_type, aggregate_id, aggregate_seq)
    WHERE aggregate_seq IS NOT NULL;

-- inbox_parked: events that arrived before an earlier event of their
-- aggregate. Parked and acked, they hold nothing in the broker (its
-- ack-pending set is shared by every aggregate); the event that fills the
-- gap applies them in order, in its own transaction. One per sequence: a
-- second event parked at a sequence is a conflict.
CREATE TABLE IF NOT EXISTS inbox_parked (
    consumer_name  text        NOT NULL,
    source         text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    aggregate_seq  bigint      NOT NULL,
    event_id       uuid        NOT NULL,
    stream         text        NOT NULL,
    stream_seq     bigint      NOT NULL,
    subject        text        NOT NULL,
    headers        jsonb       NOT NULL,
    payload        bytea       NOT NULL,
    parked_at      timestamptz NOT NULL DEFAULT now(),
    discarded_at   timestamptz,            -- an operator dropped it (kept for audit)
    discard_reason text,
    PRIMARY KEY (consumer_name, source, aggregate_type, aggregate_id, aggregate_seq)
);
CREATE INDEX IF NOT EXISTS inbox_parked_open ON inbox_parked (consumer_name, parked_at) WHERE discarded_at IS NULL;

-- dead_letters: a conflict names the event already applied at the
-- sequence; a dead letter an operator discards is resolved and keeps why.
ALTER TABLE dead_letters
    ADD COLUMN IF NOT EXISTS conflict_with  uuid,
    ADD COLUMN IF NOT EXISTS discarded_at   timestamptz,
    ADD COLUMN IF NOT EXISTS discard_reason text;
