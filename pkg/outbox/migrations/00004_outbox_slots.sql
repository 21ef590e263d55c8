-- The relay by change data capture (Config.Mode = ModeCDC) reads new
-- events from a logical replication slot. Idempotent, like 00001.

-- +goose Up

-- outbox_slots: when the relay that streams a slot last had confirmed
-- everything it had been sent. The slot's own row in pg_replication_slots
-- says how many bytes of WAL it holds back, but not for how long; this
-- does (ReadSlot's LagAge). Written by that relay's heartbeat, once a
-- second, no transaction of its own.
CREATE TABLE IF NOT EXISTS outbox_slots (
    slot         text        PRIMARY KEY,
    caught_up_at timestamptz NOT NULL
);
