-- Payment opens an order's intent when it reads OrderCreated, in parallel
-- with inventory's reservation, and announces it (PaymentOpened); the order
-- saga shows WAIT_PAY only once it holds both answers. So an order a
-- client sees waiting for payment always has an open intent here, and a
-- payment made at that instant is applied, never refused as "not payable"
-- (docs/architecture.md, "Paying the moment the order says so").
--
-- intent_id is the intent's own id, announced in PaymentOpened and shown in
-- the order (GET /orders/{id}, "payment"); opened_at is when it was opened
-- and announced (NULL for intents opened before this version, or made by
-- an OrderPaid of an order payment never saw created), which shop verify
-- pairs with the PaymentOpened events.
--
-- 'PENDING' (stock not held yet: not payable) is no longer written: an open
-- intent takes any payment of its amount, and the saga refunds one made for
-- an order that is not waiting for payment. Existing PENDING intents become
-- PAYABLE. The check still admits 'PENDING' so that a copy of the previous
-- version, running while this one rolls out, does not fail its inserts.

-- +goose Up
ALTER TABLE intents
    ADD COLUMN intent_id uuid NOT NULL DEFAULT gen_random_uuid(),
    ADD COLUMN opened_at timestamptz;
CREATE UNIQUE INDEX intents_intent_id ON intents (intent_id);
UPDATE intents SET state = 'PAYABLE', updated_at = now() WHERE state = 'PENDING';

-- +goose Down
DROP INDEX intents_intent_id;
ALTER TABLE intents DROP COLUMN opened_at, DROP COLUMN intent_id;
