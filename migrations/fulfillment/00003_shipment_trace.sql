-- The trace context (traceparent, tracestate) of the transaction that started
-- a shipment, so that its delivery, seconds or days later, continues the
-- order's trace instead of starting one of its own.

-- +goose Up
ALTER TABLE shipments ADD COLUMN trace_headers jsonb NOT NULL DEFAULT '{}';

-- +goose Down
ALTER TABLE shipments DROP COLUMN trace_headers;
