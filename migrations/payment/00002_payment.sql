-- The payment schema's own tables. Intents are learned from ORDERS events;
-- payments from verified provider callbacks; refunds from RefundRequested.

-- +goose Up

-- What payment knows about each order: only what the ORDERS events said.
-- The webhook reads it to refuse paying an order whose stock is not held yet
-- (PENDING) and to check the amount.
CREATE TABLE intents (
    order_id   text        PRIMARY KEY,
    state      text        NOT NULL CHECK (state IN ('PENDING', 'PAYABLE', 'PAID', 'CLOSED')),
    amount     bigint      NOT NULL CHECK (amount >= 0), -- the order total, in cents
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- One row per provider callback that was accepted. The unique provider id
-- makes a replayed callback a no-op instead of a second charge.
CREATE TABLE payments (
    payment_id          uuid        PRIMARY KEY,
    order_id            text        NOT NULL REFERENCES intents (order_id),
    provider_payment_id text        NOT NULL UNIQUE,
    status              text        NOT NULL CHECK (status IN ('succeeded', 'failed')),
    amount              bigint      NOT NULL CHECK (amount >= 0),
    created_at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX payments_order_id ON payments (order_id);

-- Refunds asked for by the order saga. At most one per payment (the saga may
-- ask twice; the provider must refund once). The idempotency key is the
-- RefundRequested event id and is sent to the provider on every attempt, so
-- a retry after an ambiguous failure cannot refund twice.
CREATE TABLE refunds (
    refund_id          uuid        PRIMARY KEY,
    order_id           text        NOT NULL,
    payment_id         uuid        NOT NULL UNIQUE REFERENCES payments (payment_id),
    idempotency_key    uuid        NOT NULL UNIQUE,
    amount             bigint      NOT NULL CHECK (amount >= 0),
    state              text        NOT NULL CHECK (state IN ('REQUESTED', 'DONE')),
    provider_refund_id text,
    attempts           integer     NOT NULL DEFAULT 0,
    last_error         text,
    -- Not before: a claim pushes it past the provider call (a lease, so that
    -- another instance does not call at the same time), a failure pushes it
    -- by the backoff.
    next_attempt_at    timestamptz NOT NULL DEFAULT now(),
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);
-- The retry loop's work queue: only refunds still open.
CREATE INDEX refunds_due ON refunds (next_attempt_at) WHERE state = 'REQUESTED';

-- +goose Down
DROP TABLE refunds;
DROP TABLE payments;
DROP TABLE intents;
