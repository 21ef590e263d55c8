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

// lockStock locks the stock rows of skus for the rest of tx and returns them
// by SKU; unknown SKUs are absent. Rows are locked in SKU order whatever the
// order of skus: every transaction that locks several stock rows goes
// through here, so two of them never wait for each other in a cycle.
func lockStock(ctx context.Context, tx pgx.Tx, skus []string) (map[string]Stock, error) {
	rows, err := tx.Query(ctx, `SELECT `+stockColumns+` FROM stock WHERE sku = ANY($1) ORDER BY sku FOR UPDATE`, skus)
	if err != nil {
		return nil, fmt.Errorf("lock stock: %w", err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Stock, error) { return scanStock(r) })
	if err != nil {
		return nil, fmt.Errorf("lock stock: %w", err)
	}
	bySKU := make(map[string]Stock, len(got))
	for _, s := range got {
		bySKU[s.SKU] = s
	}
	return bySKU, nil
}

// reservationState reports what is recorded about orderID: whether any
// reservation rows exist (in any state) and whether it has a tombstone.
func reservationState(ctx context.Context, tx pgx.Tx, orderID string) (decided, released bool, err error) {
	err = tx.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM reservations WHERE order_id = $1),
		       EXISTS (SELECT 1 FROM released_orders WHERE order_id = $1)`, orderID).Scan(&decided, &released)
	if err != nil {
		return false, false, fmt.Errorf("read reservation state of %s: %w", orderID, err)
	}
	return decided, released, nil
}

// insertReservation holds items for orderID: stock.reserved grows and one
// RESERVED row per SKU is written. The caller has locked the stock rows
// (lockStock) and checked availability under that lock.
func insertReservation(ctx context.Context, tx pgx.Tx, orderID string, items []Item) error {
	skus, qtys := columns(items)
	if _, err := tx.Exec(ctx, `
		UPDATE stock SET reserved = stock.reserved + q.qty, updated_at = now()
		FROM unnest($1::text[], $2::bigint[]) AS q(sku, qty)
		WHERE stock.sku = q.sku`, skus, qtys); err != nil {
		return fmt.Errorf("reserve stock for %s: %w", orderID, err)
	}
	if _, err := tx.Exec(ctx, `
		INSERT INTO reservations (order_id, sku, quantity, state)
		SELECT $1, q.sku, q.qty, 'RESERVED'
		FROM unnest($2::text[], $3::bigint[]) AS q(sku, qty)`, orderID, skus, qtys); err != nil {
		return fmt.Errorf("insert reservations of %s: %w", orderID, err)
	}
	return nil
}

// heldItems locks and returns what orderID holds in RESERVED state, in SKU
// order. The reservation rows are locked before the stock rows; reserving
// locks stock first and then only inserts rows of its own order, which no
// other transaction can hold, so the two orders cannot form a cycle.
func heldItems(ctx context.Context, tx pgx.Tx, orderID string) ([]Item, error) {
	rows, err := tx.Query(ctx, `
		SELECT sku, quantity FROM reservations
		WHERE order_id = $1 AND state = 'RESERVED'
		ORDER BY sku FOR UPDATE`, orderID)
	if err != nil {
		return nil, fmt.Errorf("read reservations of %s: %w", orderID, err)
	}
	items, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Item])
	if err != nil {
		return nil, fmt.Errorf("read reservations of %s: %w", orderID, err)
	}
	return items, nil
}

// releaseHeld returns the held items of orderID to available stock.
func releaseHeld(ctx context.Context, tx pgx.Tx, orderID string, items []Item) error {
	skus, qtys := columns(items)
	if _, err := lockStock(ctx, tx, skus); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `
		UPDATE stock SET reserved = stock.reserved - q.qty, updated_at = now()
		FROM unnest($1::text[], $2::bigint[]) AS q(sku, qty)
		WHERE stock.sku = q.sku`, skus, qtys); err != nil {
		return fmt.Errorf("release stock of %s: %w", orderID, err)
	}
	return setState(ctx, tx, orderID, "RELEASED")
}

// commitHeld turns the held items of orderID into sold units: they leave
// on_hand and reserved and join sold, so on_hand + sold stays equal to
// supplied.
func commitHeld(ctx context.Context, tx pgx.Tx, orderID string, items []Item) error {
	skus, qtys := columns(items)
	if _, err := lockStock(ctx, tx, skus); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `
		UPDATE stock
		SET on_hand  = stock.on_hand - q.qty,
		    reserved = stock.reserved - q.qty,
		    sold     = stock.sold + q.qty,
		    updated_at = now()
		FROM unnest($1::text[], $2::bigint[]) AS q(sku, qty)
		WHERE stock.sku = q.sku`, skus, qtys); err != nil {
		return fmt.Errorf("commit stock of %s: %w", orderID, err)
	}
	return setState(ctx, tx, orderID, "COMMITTED")
}

func setState(ctx context.Context, tx pgx.Tx, orderID, state string) error {
	if _, err := tx.Exec(ctx, `
		UPDATE reservations SET state = $2, updated_at = now()
		WHERE order_id = $1 AND state = 'RESERVED'`, orderID, state); err != nil {
		return fmt.Errorf("mark reservations of %s %s: %w", orderID, state, err)
	}
	return nil
}

// insertTombstone records that orderID was released while nothing was held
// for it, so that its OrderCreated, should it come later, reserves nothing.
func insertTombstone(ctx context.Context, tx pgx.Tx, orderID string) error {
	if _, err := tx.Exec(ctx, `
		INSERT INTO released_orders (order_id) VALUES ($1)
		ON CONFLICT (order_id) DO NOTHING`, orderID); err != nil {
		return fmt.Errorf("insert tombstone of %s: %w", orderID, err)
	}
	return nil
}

func columns(items []Item) (skus []string, qtys []int64) {
	for _, it := range items {
		skus = append(skus, it.SKU)
		qtys = append(qtys, it.Quantity)
	}
	return skus, qtys
}
