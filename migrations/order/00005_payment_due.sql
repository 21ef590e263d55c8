-- What a client needs to pay an order, shown by GET /orders/{id} as
-- "payment" from WAIT_PAY on: payment's intent (announced by PaymentOpened)
-- and the time the payment timeout closes the order. Both are written by
-- the saga's move to WAIT_PAY, so an order shows them exactly when payment
-- has opened the intent they name.
--
-- orders.status mirrors the saga's state (00003) with one exception since
-- this version: the saga's two join states, STOCK_HELD and PAYMENT_OPEN
-- (one of the two answers in), show as PENDING.

-- +goose Up
ALTER TABLE orders
    ADD COLUMN payment_intent_id uuid,
    ADD COLUMN pay_by timestamptz;

-- +goose Down
ALTER TABLE orders DROP COLUMN pay_by, DROP COLUMN payment_intent_id;
