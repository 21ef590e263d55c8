-- +goose Up
-- What the two streams said of each order, whichever came first: the
-- customer (OrderCreated), whether it completed (OrderCompleted), and its
-- payments (PaymentSucceeded, PaymentRefunded). settle derives the order's
-- points from these, so no event needs another to have come before it.
CREATE TABLE orders (
    order_id    text    PRIMARY KEY,
    customer_id text,
    completed   boolean NOT NULL DEFAULT false
);
CREATE TABLE payments (
    payment_id text   PRIMARY KEY,
    order_id   text   NOT NULL,
    succeeded  bigint,                    -- NULL: no PaymentSucceeded (yet, or ever: a rejected payment's refund)
    refunded   bigint NOT NULL DEFAULT 0
);
-- A ledger: one row, and one PointsAwarded, per change of an order's
-- points (negative when a refund takes them back).
CREATE TABLE awards (
    award_id    bigserial   PRIMARY KEY,
    order_id    text        NOT NULL,
    customer_id text        NOT NULL,
    points      bigint      NOT NULL,
    awarded_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX awards_order ON awards (order_id);
CREATE TABLE points (
    customer_id text   PRIMARY KEY,
    points      bigint NOT NULL
);
