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
