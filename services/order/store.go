package order

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Order states, as the contract names them.
const (
	Pending    = "PENDING"
	WaitPay    = "WAIT_PAY"
	Paid       = "PAID"
	Fulfilling = "FULFILLING"
	Completed  = "COMPLETED"
	Rejected   = "REJECTED"
	Closed     = "CLOSED"
)

// Order is the order as the API shows it.
type Order struct {
	ID         uuid.UUID `json:"order_id"`
	CustomerID string    `json:"customer_id"`
	Status     string    `json:"status"`
	Items      []Item    `json:"items"`
	Total      int64     `json:"total"`
	CreatedAt  time.Time `json:"created_at"`
	UpdatedAt  time.Time `json:"updated_at"`
	History    []Entry   `json:"history"`
}

// Item is one order line. UnitPrice is in cents, from the catalogue.
type Item struct {
	SKU       string `json:"sku"`
	Quantity  int    `json:"quantity"`
	UnitPrice int64  `json:"unit_price"`
}

// Entry is one line of an order's history.
type Entry struct {
	Status string    `json:"status"`
	At     time.Time `json:"at"`
	Reason string    `json:"reason,omitempty"`
}

// ErrNotFound means there is no such order.
var ErrNotFound = errors.New("order not found")

// db is what the read functions need: a pool or a tx.
type db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// now is the time stamps are taken at, cut to Postgres' microseconds so that
// a response built in Go equals the order read back later.
func now() time.Time { return time.Now().UTC().Truncate(time.Microsecond) }

// insertOrder writes a new PENDING order, its items and its first history
// entry inside tx.
func insertOrder(ctx context.Context, tx pgx.Tx, o Order) error {
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO orders (order_id, customer_id, status, total, version, created_at, updated_at)
		VALUES ($1, $2, $3, $4, 1, $5, $5)`, o.ID, o.CustomerID, o.Status, o.Total, o.CreatedAt)
	for i, it := range o.Items {
		b.Queue(`INSERT INTO order_items (order_id, line, sku, quantity, unit_price) VALUES ($1, $2, $3, $4, $5)`,
			o.ID, i+1, it.SKU, it.Quantity, it.UnitPrice)
	}
	for _, h := range o.History {
		b.Queue(`INSERT INTO order_history (order_id, status, at, reason) VALUES ($1, $2, $3, NULLIF($4, ''))`,
			o.ID, h.Status, h.At, h.Reason)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("insert order %s: %w", o.ID, err)
	}
	return nil
}

// setStatus moves the order row to status (a saga transition), bumps its
// version and appends the history entry, inside the transition's tx.
func setStatus(ctx context.Context, tx pgx.Tx, id uuid.UUID, status, reason string) error {
	at := now()
	b := &pgx.Batch{}
	b.Queue(`UPDATE orders SET status = $2, version = version + 1, updated_at = $3 WHERE order_id = $1`, id, status, at)
	b.Queue(`INSERT INTO order_history (order_id, status, at, reason) VALUES ($1, $2, $3, NULLIF($4, ''))`, id, status, at, reason)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("order %s to %s: %w", id, status, err)
	}
	return nil
}

// getOrder reads an order with its items and history, oldest entry first.
func getOrder(ctx context.Context, db db, id uuid.UUID) (Order, error) {
	o := Order{ID: id, Items: []Item{}, History: []Entry{}}
	err := db.QueryRow(ctx, `SELECT customer_id, status, total, created_at, updated_at FROM orders WHERE order_id = $1`, id).
		Scan(&o.CustomerID, &o.Status, &o.Total, &o.CreatedAt, &o.UpdatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return o, ErrNotFound
	}
	if err != nil {
		return o, fmt.Errorf("read order %s: %w", id, err)
	}
	rows, _ := db.Query(ctx, `SELECT sku, quantity, unit_price FROM order_items WHERE order_id = $1 ORDER BY line`, id)
	if o.Items, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Item]); err != nil {
		return o, fmt.Errorf("read items of order %s: %w", id, err)
	}
	rows, _ = db.Query(ctx, `SELECT status, at, coalesce(reason, '') FROM order_history WHERE order_id = $1 ORDER BY id`, id)
	if o.History, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Entry]); err != nil {
		return o, fmt.Errorf("read history of order %s: %w", id, err)
	}
	o.CreatedAt, o.UpdatedAt = o.CreatedAt.UTC(), o.UpdatedAt.UTC()
	for i := range o.History {
		o.History[i].At = o.History[i].At.UTC()
	}
	return o, nil
}

// prices reads the catalogue prices of skus.
func prices(ctx context.Context, db db, skus []string) (map[string]int64, error) {
	rows, _ := db.Query(ctx, `SELECT sku, price FROM catalogue WHERE sku = ANY($1)`, skus)
	out := map[string]int64{}
	var sku string
	var price int64
	_, err := pgx.ForEachRow(rows, []any{&sku, &price}, func() error { out[sku] = price; return nil })
	if err != nil {
		return nil, fmt.Errorf("read catalogue: %w", err)
	}
	return out, nil
}

// upsertProduct stores a catalogue price, unless the stored one came from a
// later event of the SKU (a higher Aggregate-Seq): an old copy, replayed or
// delivered late, never brings an old price back.
func upsertProduct(ctx context.Context, tx pgx.Tx, sku string, price, seq int64) error {
	_, err := tx.Exec(ctx, `
		INSERT INTO catalogue (sku, price, seq, updated_at) VALUES ($1, $2, $3, now())
		ON CONFLICT (sku) DO UPDATE SET price = EXCLUDED.price, seq = EXCLUDED.seq, updated_at = now()
		WHERE catalogue.seq < EXCLUDED.seq`, sku, price, seq)
	if err != nil {
		return fmt.Errorf("update catalogue %s: %w", sku, err)
	}
	return nil
}

// storedKey is an Idempotency-Key's record.
type storedKey struct {
	hash     []byte
	status   int
	response []byte
}

// lookupKey returns the unexpired record of key, or nil. Expired records are
// treated as absent and deleted here, so the key can be used afresh.
func lookupKey(ctx context.Context, tx pgx.Tx, key string) (*storedKey, error) {
	var k storedKey
	var expired bool
	err := tx.QueryRow(ctx, `SELECT request_hash, status_code, response, expires_at <= now() FROM idempotency_keys WHERE key = $1`, key).
		Scan(&k.hash, &k.status, &k.response, &expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read idempotency key: %w", err)
	}
	if expired {
		if _, err := tx.Exec(ctx, `DELETE FROM idempotency_keys WHERE key = $1`, key); err != nil {
			return nil, fmt.Errorf("delete expired idempotency key: %w", err)
		}
		return nil, nil
	}
	return &k, nil
}

func insertKey(ctx context.Context, tx pgx.Tx, key string, hash []byte, status int, response []byte, orderID uuid.UUID, ttl time.Duration) error {
	_, err := tx.Exec(ctx, `INSERT INTO idempotency_keys (key, request_hash, status_code, response, order_id, expires_at)
		VALUES ($1, $2, $3, $4, $5, now() + $6::bigint * interval '1 microsecond')`,
		key, hash, status, response, orderID, ttl.Microseconds())
	if err != nil {
		return fmt.Errorf("store idempotency key: %w", err)
	}
	return nil
}

// deleteExpiredKeys deletes expired keys in batches, so no one statement
// holds many row locks.
func deleteExpiredKeys(ctx context.Context, db db) (int64, error) {
	var total int64
	for {
		tag, err := db.Exec(ctx, `DELETE FROM idempotency_keys WHERE key IN (
			SELECT key FROM idempotency_keys WHERE expires_at <= now() LIMIT 1000 FOR UPDATE SKIP LOCKED)`)
		if err != nil {
			return total, fmt.Errorf("delete expired idempotency keys: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < 1000 {
			return total, nil
		}
	}
}
