-- +goose Up

-- shipments: one per paid order. order_id is the key, so a second OrderPaid
-- for the same order (a replay, or a second event id for one payment) finds
-- the row and creates nothing.
--
-- deliver_at is the carrier's durable timer: a row rather than an in-memory
-- timer, so a shipment that falls due while no process runs is delivered by
-- the first scanner that comes back.
CREATE TABLE shipments (
    order_id     uuid        PRIMARY KEY,
    shipment_id  uuid        NOT NULL UNIQUE,
    state        text        NOT NULL DEFAULT 'STARTED'
                             CHECK (state IN ('STARTED', 'DELIVERED')),
    items        jsonb       NOT NULL,           -- [{"sku","quantity"}] from OrderPaid
    started_at   timestamptz NOT NULL DEFAULT now(),
    deliver_at   timestamptz NOT NULL,
    delivered_at timestamptz,
    CHECK ((state = 'DELIVERED') = (delivered_at IS NOT NULL))
);

-- The delivery scanner's work queue: only shipments still on their way, so
-- the index stays small however many have been delivered.
CREATE INDEX shipments_due ON shipments (deliver_at) WHERE state = 'STARTED';

-- +goose Down
DROP TABLE shipments;
