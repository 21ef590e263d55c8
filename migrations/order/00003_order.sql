-- +goose Up
-- The order service's own tables. orders.status mirrors the saga instance's
-- state (saga_instances), updated in the same transaction, for cheap reads.

CREATE TABLE orders (
    order_id    uuid        PRIMARY KEY,
    customer_id text        NOT NULL,
    status      text        NOT NULL,
    total       bigint      NOT NULL CHECK (total >= 0),   -- cents
    version     bigint      NOT NULL DEFAULT 1,
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL
);

CREATE TABLE order_items (
    order_id   uuid    NOT NULL REFERENCES orders (order_id),
    line       integer NOT NULL,
    sku        text    NOT NULL,
    quantity   integer NOT NULL CHECK (quantity BETWEEN 1 AND 1000),
    unit_price bigint  NOT NULL CHECK (unit_price >= 0),
    PRIMARY KEY (order_id, line)
);

-- Every state the order has been in, and facts worth showing beside them
-- (a refund requested or confirmed). id keeps entries of one instant in order.
CREATE TABLE order_history (
    id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id uuid        NOT NULL REFERENCES orders (order_id),
    status   text        NOT NULL,
    at       timestamptz NOT NULL,
    reason   text
);
CREATE INDEX order_history_order ON order_history (order_id, id);

-- The service's copy of inventory's catalogue, from ProductUpdated. seq is
-- the event's Aggregate-Seq: an older event never overwrites a newer price.
CREATE TABLE catalogue (
    sku        text        PRIMARY KEY,
    price      bigint      NOT NULL CHECK (price >= 0),
    seq        bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Idempotency-Key records: written in the transaction that creates the
-- order, so a key exists exactly when its order does.
CREATE TABLE idempotency_keys (
    key          text        PRIMARY KEY,
    request_hash bytea       NOT NULL,
    status_code  integer     NOT NULL,
    response     jsonb       NOT NULL,
    order_id     uuid        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at);

-- +goose Down
DROP TABLE idempotency_keys;
DROP TABLE catalogue;
DROP TABLE order_history;
DROP TABLE order_items;
DROP TABLE orders;
