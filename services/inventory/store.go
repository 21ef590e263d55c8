package inventory

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNotFound means no stock row exists for the SKU.
var ErrNotFound = errors.New("inventory: sku not found")

// ErrBelowReserved means a restock would set on_hand below the units held for
// open orders. A *BelowReservedError matches it.
var ErrBelowReserved = errors.New("inventory: on_hand below reserved")

// BelowReservedError is a refused restock, with the numbers an operator needs.
type BelowReservedError struct {
	SKU      string
	OnHand   int64 // what was asked for
	Reserved int64 // what open orders hold
}

func (e *BelowReservedError) Error() string {
	return fmt.Sprintf("inventory: on_hand %d for %s is below the %d units reserved", e.OnHand, e.SKU, e.Reserved)
}

// Is makes errors.Is(err, ErrBelowReserved) true.
func (e *BelowReservedError) Is(target error) bool { return target == ErrBelowReserved }

// Stock is one SKU's stock as the API shows it.
type Stock struct {
	SKU       string `json:"sku"`
	OnHand    int64  `json:"on_hand"`
	Reserved  int64  `json:"reserved"`
	Available int64  `json:"available"` // on_hand - reserved: what new orders may take
	Sold      int64  `json:"sold"`
	Price     int64  `json:"price"` // cents
}

// db is what the read functions need: a pool, a connection or a tx.
type db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

const stockColumns = `sku, on_hand, reserved, on_hand - reserved, sold, price`

func scanStock(row pgx.Row) (Stock, error) {
	var s Stock
	err := row.Scan(&s.SKU, &s.OnHand, &s.Reserved, &s.Available, &s.Sold, &s.Price)
	return s, err
}

// getStock reads one SKU's stock.
func getStock(ctx context.Context, q db, sku string) (Stock, error) {
	s, err := scanStock(q.QueryRow(ctx, `SELECT `+stockColumns+` FROM stock WHERE sku = $1`, sku))
	if errors.Is(err, pgx.ErrNoRows) {
		return Stock{}, fmt.Errorf("get stock %s: %w", sku, ErrNotFound)
	}
	if err != nil {
		return Stock{}, fmt.Errorf("get stock %s: %w", sku, err)
	}
	return s, nil
}

// setStock sets on_hand and price of sku absolutely, creating the row if
// needed, inside tx. supplied moves by the change of on_hand, which keeps
// on_hand + sold = supplied. One statement does it all: the upsert takes the
// row lock, so a reservation committing at the same moment is either
// counted in reserved before the check or waits for this restock; the check
// can never race with it.
func setStock(ctx context.Context, tx pgx.Tx, sku string, onHand, price int64) (Stock, error) {
	s, err := scanStock(tx.QueryRow(ctx, `
		INSERT INTO stock AS s (sku, on_hand, reserved, sold, price, supplied)
		VALUES ($1, $2, 0, 0, $3, $2)
		ON CONFLICT (sku) DO UPDATE
		SET on_hand    = EXCLUDED.on_hand,
		    price      = EXCLUDED.price,
		    supplied   = s.supplied + EXCLUDED.on_hand - s.on_hand,
		    updated_at = now()
		WHERE s.reserved <= EXCLUDED.on_hand
		RETURNING `+stockColumns, sku, onHand, price))
	if errors.Is(err, pgx.ErrNoRows) {
		// The WHERE refused the update; the row is locked by the upsert
		// until tx ends, so this reading is the one that refused it.
		var reserved int64
		if err := tx.QueryRow(ctx, `SELECT reserved FROM stock WHERE sku = $1`, sku).Scan(&reserved); err != nil {
			return Stock{}, fmt.Errorf("set stock %s: read reserved: %w", sku, err)
		}
		return Stock{}, &BelowReservedError{SKU: sku, OnHand: onHand, Reserved: reserved}
	}
	if err != nil {
		return Stock{}, fmt.Errorf("set stock %s: %w", sku, err)
	}
	return s, nil
}

// queueLockStock queues into b the statement that locks the stock rows of
// skus for the rest of the transaction; when b is sent it stores them in
// into by SKU (unknown SKUs are absent), or only locks them if into is nil.
// Rows are locked in SKU order whatever the order of skus: every
// transaction that locks several stock rows goes through here, so two of
// them never wait for each other in a cycle. What b queues after it runs
// once every lock is held.
func queueLockStock(b *pgx.Batch, skus []string, into map[string]Stock) {
	q := b.Queue(`SELECT `+stockColumns+` FROM stock WHERE sku = ANY($1) ORDER BY sku FOR UPDATE`, skus)
	if into == nil {
		return // the rows are read and dropped when b is closed; the locks stay
	}
	q.Query(func(rows pgx.Rows) error {
		for rows.Next() {
			s, err := scanStock(rows)
			if err != nil {
				return err
			}
			into[s.SKU] = s
		}
		return rows.Err()
	})
}

// reservationState is what is recorded about an order when its
// OrderCreated is handled, and the stock its lines ask for.
type reservationState struct {
	decided  bool             // reservation rows exist, in any state
	released bool             // the order has a tombstone
	stock    map[string]Stock // locked for the rest of tx, by SKU; unknown SKUs are absent
}

// lockForReservation reads what is recorded about orderID and locks the
// stock rows of skus (queueLockStock), in one round trip. The stock rows
// are locked even when the order turns out to be decided already: that is
// a rare copy of an event, and costs only locks held until tx ends.
func lockForReservation(ctx context.Context, tx pgx.Tx, orderID string, skus []string) (reservationState, error) {
	st := reservationState{stock: make(map[string]Stock, len(skus))}
	b := &pgx.Batch{}
	b.Queue(`
		SELECT EXISTS (SELECT 1 FROM reservations WHERE order_id = $1),
		       EXISTS (SELECT 1 FROM released_orders WHERE order_id = $1)`, orderID,
	).QueryRow(func(r pgx.Row) error { return r.Scan(&st.decided, &st.released) })
	queueLockStock(b, skus, st.stock)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return reservationState{}, fmt.Errorf("read reservation state of %s and lock its stock: %w", orderID, err)
	}
	return st, nil
}

// queueReservation queues into b what holds items for orderID:
// stock.reserved grows and one RESERVED row per SKU is written. The caller
// has locked the stock rows (lockForReservation) and checked availability
// under that lock.
func queueReservation(b *pgx.Batch, orderID string, items []Item) {
	skus, qtys := columns(items)
	b.Queue(`
		UPDATE stock SET reserved = stock.reserved + q.qty, updated_at = now()
		FROM unnest($1::text[], $2::bigint[]) AS q(sku, qty)
		WHERE stock.sku = q.sku`, skus, qtys)
	b.Queue(`
		INSERT INTO reservations (order_id, sku, quantity, state)
		SELECT $1, q.sku, q.qty, 'RESERVED'
		FROM unnest($2::text[], $3::bigint[]) AS q(sku, qty)`, orderID, skus, qtys)
}

// heldSQL locks and returns what an order holds in RESERVED state, in SKU
// order. The reservation rows are locked before the stock rows; reserving
// locks stock first and then only inserts rows of its own order, which no
// other transaction can hold, so the two orders cannot form a cycle.
const heldSQL = `
	SELECT sku, quantity FROM reservations
	WHERE order_id = $1 AND state = 'RESERVED'
	ORDER BY sku FOR UPDATE`

// heldItems locks and returns what orderID holds (heldSQL).
func heldItems(ctx context.Context, tx pgx.Tx, orderID string) ([]Item, error) {
	rows, err := tx.Query(ctx, heldSQL, orderID)
	if err != nil {
		return nil, fmt.Errorf("read reservations of %s: %w", orderID, err)
	}
	items, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Item])
	if err != nil {
		return nil, fmt.Errorf("read reservations of %s: %w", orderID, err)
	}
	return items, nil
}

// heldOrTombstone is heldItems for a release: when orderID holds nothing
// it also records that the order was released (a tombstone), so that its
// OrderCreated, should it come later, reserves nothing. Both statements go
// in one round trip; the tombstone's own check for RESERVED rows runs after
// heldSQL has locked them, so it agrees with the items returned.
func heldOrTombstone(ctx context.Context, tx pgx.Tx, orderID string) ([]Item, error) {
	var items []Item
	b := &pgx.Batch{}
	b.Queue(heldSQL, orderID).Query(func(rows pgx.Rows) error {
		var err error
		items, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Item])
		return err
	})
	b.Queue(`
		INSERT INTO released_orders (order_id)
		SELECT $1 WHERE NOT EXISTS (
			SELECT 1 FROM reservations WHERE order_id = $1 AND state = 'RESERVED')
		ON CONFLICT (order_id) DO NOTHING`, orderID)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("read reservations of %s or leave its tombstone: %w", orderID, err)
	}
	return items, nil
}

// queueRelease queues into b what returns the held items of orderID to
// available stock.
func queueRelease(b *pgx.Batch, orderID string, items []Item) {
	skus, qtys := columns(items)
	queueLockStock(b, skus, nil)
	b.Queue(`
		UPDATE stock SET reserved = stock.reserved - q.qty, updated_at = now()
		FROM unnest($1::text[], $2::bigint[]) AS q(sku, qty)
		WHERE stock.sku = q.sku`, skus, qtys)
	queueSetState(b, orderID, "RELEASED")
}

// queueCommit queues into b what turns the held items of orderID into sold
// units: they leave on_hand and reserved and join sold, so on_hand + sold
// stays equal to supplied.
func queueCommit(b *pgx.Batch, orderID string, items []Item) {
	skus, qtys := columns(items)
	queueLockStock(b, skus, nil)
	b.Queue(`
		UPDATE stock
		SET on_hand  = stock.on_hand - q.qty,
		    reserved = stock.reserved - q.qty,
		    sold     = stock.sold + q.qty,
		    updated_at = now()
		FROM unnest($1::text[], $2::bigint[]) AS q(sku, qty)
		WHERE stock.sku = q.sku`, skus, qtys)
	queueSetState(b, orderID, "COMMITTED")
}

func queueSetState(b *pgx.Batch, orderID, state string) {
	b.Queue(`
		UPDATE reservations SET state = $2, updated_at = now()
		WHERE order_id = $1 AND state = 'RESERVED'`, orderID, state)
}

func columns(items []Item) (skus []string, qtys []int64) {
	for _, it := range items {
		skus = append(skus, it.SKU)
		qtys = append(qtys, it.Quantity)
	}
	return skus, qtys
}
