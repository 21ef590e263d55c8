-- The trace context (traceparent, tracestate) of the transaction that armed a
-- timeout, so that the transition it fires, minutes later, continues the
-- order's trace.

-- +goose Up
ALTER TABLE saga_timeouts ADD COLUMN trace_headers jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE saga_timeouts DROP COLUMN trace_headers;
