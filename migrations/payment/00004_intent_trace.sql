-- The trace context (traceparent, tracestate) of the transaction that made an
-- intent payable, so that the provider's callback, a request from outside
-- with no trace of ours, continues the order's trace.

-- +goose Up
ALTER TABLE intents ADD COLUMN trace_headers jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE intents DROP COLUMN trace_headers;
