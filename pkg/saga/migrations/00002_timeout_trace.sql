-- The trace context (traceparent, tracestate) of the transaction that armed a
-- timeout, so that the transition it fires, minutes later, continues the
-- trace of the saga instance.

-- +goose Up
ALTER TABLE saga_timeouts ADD COLUMN IF NOT EXISTS trace_headers jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE saga_timeouts DROP COLUMN trace_headers;
