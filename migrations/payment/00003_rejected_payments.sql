-- +goose Up
-- A provider callback that says money was taken which the shop cannot
-- apply (the amount differs from the order total, the order's stock is not
-- held yet, or payment does not know the order) used to be refused and
-- written nowhere: the provider kept the money and no one could see it. It
-- is now recorded as a payment with status 'rejected' and a reason, with a
-- refund (refunds, keyed by the payment id) that the refund loop carries
-- out through the provider like any other.
--
-- 'rejected' is a status of its own so that every reader of 'succeeded'
-- (the saga's payments, verify's charged-twice check, the reconciler) keeps
-- meaning money applied to an order. Such a payment may name an order this
-- service never heard of, so payments no longer reference intents.
ALTER TABLE payments
    DROP CONSTRAINT payments_order_id_fkey,
    DROP CONSTRAINT payments_status_check,
    ADD CONSTRAINT payments_status_check CHECK (status IN ('succeeded', 'failed', 'rejected')),
    ADD COLUMN reject_reason text
        CHECK (reject_reason IN ('amount_mismatch', 'not_payable', 'unknown_order')),
    ADD CONSTRAINT payments_rejected_have_a_reason CHECK ((status = 'rejected') = (reject_reason IS NOT NULL));

-- +goose Down
DELETE FROM refunds WHERE payment_id IN (SELECT payment_id FROM payments WHERE status = 'rejected');
DELETE FROM payments WHERE status = 'rejected';
ALTER TABLE payments
    DROP CONSTRAINT payments_rejected_have_a_reason,
    DROP COLUMN reject_reason,
    DROP CONSTRAINT payments_status_check,
    ADD CONSTRAINT payments_status_check CHECK (status IN ('succeeded', 'failed')),
    ADD CONSTRAINT payments_order_id_fkey FOREIGN KEY (order_id) REFERENCES intents (order_id);
