-- +goose Up

-- stock: one row per SKU. The CHECKs are the stock invariants of the
-- contract, enforced by the database so that no code path (a handler bug, an
-- operator's SQL) can leave them broken: reserved is a part of on_hand, and
-- on_hand + sold = supplied, where supplied counts every unit ever put on
-- the shelf by restocks (PUT /stock adds new on_hand - old on_hand, negative
-- when an operator corrects stock down). Sales move units from on_hand to
-- sold and leave supplied alone, so `shop verify` can check conservation.
CREATE TABLE stock (
    sku        text        PRIMARY KEY CHECK (sku ~ '^[A-Za-z0-9_-]{1,64}$'),
    on_hand    bigint      NOT NULL CHECK (on_hand >= 0),
    reserved   bigint      NOT NULL DEFAULT 0 CHECK (reserved >= 0 AND reserved <= on_hand),
    sold       bigint      NOT NULL DEFAULT 0 CHECK (sold >= 0),
    price      bigint      NOT NULL CHECK (price >= 0),      -- cents
    supplied   bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT stock_conserved CHECK (on_hand + sold = supplied)
);

-- reservations: what each order holds, per SKU. RESERVED units count in
-- stock.reserved; RELEASED went back to available stock; COMMITTED were sold.
-- Rows are kept after they leave RESERVED: they record that the order's
-- reservation was decided, so a late copy of OrderCreated reserves nothing.
CREATE TABLE reservations (
    order_id   text        NOT NULL,
    sku        text        NOT NULL REFERENCES stock (sku),
    quantity   bigint      NOT NULL CHECK (quantity > 0),
    state      text        NOT NULL CHECK (state IN ('RESERVED', 'RELEASED', 'COMMITTED')),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, sku)
);

-- `shop verify` sums what is still held per SKU.
CREATE INDEX reservations_held ON reservations (sku) WHERE state = 'RESERVED';

-- released_orders: tombstones of orders released before anything was
-- reserved for them (OrderClosed/OrderRejected handled first). An
-- OrderCreated that arrives afterwards finds the tombstone and holds nothing,
-- so a closed order can never strand reserved stock.
CREATE TABLE released_orders (
    order_id    text        PRIMARY KEY,
    released_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE released_orders;
DROP TABLE reservations;
DROP TABLE stock;
