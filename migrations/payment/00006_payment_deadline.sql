-- Payment owns the payment deadline. The order decides pay_by when it
-- enters WAIT_PAY and says so in OrderAwaitingPayment; payment keeps it on
-- the intent and decides, under the intent's row lock, whether a capture
-- was in time. At pay_by an intent nobody paid becomes EXPIRED (and
-- PaymentExpired is published in the same transaction); the order closes on
-- that word, never on a timer of its own (docs/architecture.md, "Who decides
-- the deadline").
--
-- A capture now moves the intent to PAID itself, in the transaction that
-- records it, and a declined payment closes it: whatever payment has
-- answered is what the intent says, so a later capture is refused (or, when
-- the provider already took the money, rejected and refunded) instead of
-- being answered "succeeded" and then refunded by the saga.
--
-- Intents paid before this version (a succeeded payment, the state still
-- PAYABLE until OrderPaid arrived) are marked PAID here, so the expiry
-- never takes an intent that was paid.

-- +goose Up
ALTER TABLE intents
    ADD COLUMN pay_by timestamptz,
    DROP CONSTRAINT intents_state_check,
    ADD CONSTRAINT intents_state_check CHECK (state IN ('PENDING', 'PAYABLE', 'PAID', 'CLOSED', 'EXPIRED'));
-- The expiry loop's work queue: open intents with a deadline.
CREATE INDEX intents_due ON intents (pay_by) WHERE state = 'PAYABLE' AND pay_by IS NOT NULL;

ALTER TABLE payments
    DROP CONSTRAINT payments_reject_reason_check,
    ADD CONSTRAINT payments_reject_reason_check CHECK (reject_reason IN (
        'amount_mismatch', 'not_payable', 'unknown_order', 'window_closed', 'order_closed', 'already_paid'));

UPDATE intents i SET state = 'PAID', updated_at = now()
WHERE state = 'PAYABLE'
  AND EXISTS (SELECT 1 FROM payments p WHERE p.order_id = i.order_id AND p.status = 'succeeded');

-- +goose Down
UPDATE payments SET reject_reason = 'not_payable'
WHERE reject_reason IN ('window_closed', 'order_closed', 'already_paid');
ALTER TABLE payments
    DROP CONSTRAINT payments_reject_reason_check,
    ADD CONSTRAINT payments_reject_reason_check CHECK (reject_reason IN ('amount_mismatch', 'not_payable', 'unknown_order'));
UPDATE intents SET state = 'CLOSED' WHERE state = 'EXPIRED';
DROP INDEX intents_due;
ALTER TABLE intents
    DROP CONSTRAINT intents_state_check,
    ADD CONSTRAINT intents_state_check CHECK (state IN ('PENDING', 'PAYABLE', 'PAID', 'CLOSED')),
    DROP COLUMN pay_by;
