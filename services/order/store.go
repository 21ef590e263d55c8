package order

import (
	"context"
	"encoding/json"
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
	// Payment is what a client needs to pay the order, from WAIT_PAY on
	// (absent before): a payment made as soon as it appears is applied.
	Payment *PaymentDue `json:"payment,omitempty"`
}

// PaymentDue is the payment an order waits for (or waited for): payment's
// intent, opened for the order, its amount (the order's total) and the time
// the payment timeout closes an unpaid order.
type PaymentDue struct {
	IntentID uuid.UUID `json:"intent_id"`
	Amount   int64     `json:"amount"`
	PayBy    time.Time `json:"pay_by"`
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
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// now is the time stamps are taken at, cut to Postgres' microseconds so that
// a response built in Go equals the order read back later.
func now() time.Time { return time.Now().UTC().Truncate(time.Microsecond) }

// The queue functions below add statements to a batch that the caller sends
// on its transaction, so that a transaction's writes cost one round trip.

// param is id as a query argument pgx encodes directly. A uuid.UUID reaches
// pgx as a driver.Valuer, which it turns into a string and parses back:
// some eighteen allocations per argument, a fifth of POST /orders' (see
// BenchmarkCreateOrder). The bytes go straight into the message.
func param(id uuid.UUID) [16]byte { return id }

// queueInsertOrder queues the writes of a new PENDING order: its row, its
// items and its first history entry.
func queueInsertOrder(b *pgx.Batch, o Order) {
	b.Queue(`INSERT INTO orders (order_id, customer_id, status, total, version, created_at, updated_at)
		VALUES ($1, $2, $3, $4, 1, $5, $5)`, param(o.ID), o.CustomerID, o.Status, o.Total, o.CreatedAt)
	for i, it := range o.Items {
		b.Queue(`INSERT INTO order_items (order_id, line, sku, quantity, unit_price) VALUES ($1, $2, $3, $4, $5)`,
			param(o.ID), i+1, it.SKU, it.Quantity, it.UnitPrice)
	}
	for _, h := range o.History {
		b.Queue(`INSERT INTO order_history (order_id, status, at, reason) VALUES ($1, $2, $3, NULLIF($4, ''))`,
			param(o.ID), h.Status, h.At, h.Reason)
	}
}

// queueStatus queues the move of the order row to status (a saga
// transition): its version is bumped and the history entry appended.
func queueStatus(b *pgx.Batch, id uuid.UUID, status, reason string) {
	at := now()
	b.Queue(`UPDATE orders SET status = $2, version = version + 1, updated_at = $3 WHERE order_id = $1`, param(id), status, at)
	b.Queue(`INSERT INTO order_history (order_id, status, at, reason) VALUES ($1, $2, $3, NULLIF($4, ''))`, param(id), status, at, reason)
}

// queuePaymentDue queues the record of the payment the order now waits for
// (Order.Payment).
func queuePaymentDue(b *pgx.Batch, id, intent uuid.UUID, payBy time.Time) {
	b.Queue(`UPDATE orders SET payment_intent_id = $2, pay_by = $3 WHERE order_id = $1`, param(id), param(intent), payBy)
}

// getOrder reads an order with its items and history, oldest entry first,
// in one round trip.
func getOrder(ctx context.Context, db db, id uuid.UUID) (Order, error) {
	o := Order{ID: id, Items: []Item{}, History: []Entry{}}
	found := false
	b := &pgx.Batch{}
	b.Queue(`SELECT customer_id, status, total, created_at, updated_at, payment_intent_id, pay_by FROM orders WHERE order_id = $1`, id).
		QueryRow(func(row pgx.Row) error {
			var intent *uuid.UUID
			var payBy *time.Time
			err := row.Scan(&o.CustomerID, &o.Status, &o.Total, &o.CreatedAt, &o.UpdatedAt, &intent, &payBy)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("read order %s: %w", id, err)
			}
			if intent != nil && payBy != nil {
				o.Payment = &PaymentDue{IntentID: *intent, Amount: o.Total, PayBy: payBy.UTC()}
			}
			found = true
			return nil
		})
	b.Queue(`SELECT sku, quantity, unit_price FROM order_items WHERE order_id = $1 ORDER BY line`, id).
		Query(func(rows pgx.Rows) (err error) {
			if o.Items, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Item]); err != nil {
				return fmt.Errorf("read items of order %s: %w", id, err)
			}
			return nil
		})
	b.Queue(`SELECT status, at, coalesce(reason, '') FROM order_history WHERE order_id = $1 ORDER BY id`, id).
		Query(func(rows pgx.Rows) (err error) {
			if o.History, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Entry]); err != nil {
				return fmt.Errorf("read history of order %s: %w", id, err)
			}
			return nil
		})
	if err := db.SendBatch(ctx, b).Close(); err != nil {
		return o, err
	}
	if !found {
		return o, ErrNotFound
	}
	o.CreatedAt, o.UpdatedAt = o.CreatedAt.UTC(), o.UpdatedAt.UTC()
	for i := range o.History {
		o.History[i].At = o.History[i].At.UTC()
	}
	return o, nil
}

// queuePrices queues the read of the catalogue prices of skus and returns
// the map it fills in when the batch is closed.
func queuePrices(b *pgx.Batch, skus []string) map[string]int64 {
	known := map[string]int64{}
	b.Queue(`SELECT sku, price FROM catalogue WHERE sku = ANY($1)`, skus).Query(func(rows pgx.Rows) error {
		var sku string
		var price int64
		_, err := pgx.ForEachRow(rows, []any{&sku, &price}, func() error { known[sku] = price; return nil })
		if err != nil {
			return fmt.Errorf("read catalogue: %w", err)
		}
		return nil
	})
	return known
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

// storedKey is an Idempotency-Key's record, as queueLookupKey reads it.
type storedKey struct {
	found    bool // there is a record, expired or not
	expired  bool // it is past its expiry: treat it as absent, and delete it
	hash     []byte
	status   int
	response []byte // the bytes the first request was answered with
}

// queueLookupKey queues the read of key's record and returns the storedKey
// it fills in when the batch is closed.
func queueLookupKey(b *pgx.Batch, key string) *storedKey {
	k := &storedKey{}
	b.Queue(`SELECT request_hash, status_code, response, response_normalized, expires_at <= now()
		FROM idempotency_keys WHERE key = $1`, key).
		QueryRow(func(row pgx.Row) error {
			var normalized bool
			err := row.Scan(&k.hash, &k.status, &k.response, &normalized, &k.expired)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("read idempotency key: %w", err)
			}
			if normalized {
				if k.response, err = reencode(k.response); err != nil {
					return fmt.Errorf("read idempotency key: %w", err)
				}
			}
			k.found = true
			return nil
		})
	return k
}

// reencode gives back the bytes of a response stored before migration
// 00004, when responses were jsonb: Postgres kept its values but not its
// bytes (keys reordered, spaces added). The response was json.Marshal of
// an Order, and decoding jsonb's text into an Order and encoding it again
// yields exactly those bytes: the same fields in struct order, the same
// RFC 3339 strings, the same escapes.
func reencode(normalized []byte) ([]byte, error) {
	var o Order
	if err := json.Unmarshal(normalized, &o); err != nil {
		return nil, fmt.Errorf("decode response stored as jsonb: %w", err)
	}
	b, err := json.Marshal(o)
	if err != nil {
		return nil, fmt.Errorf("encode response stored as jsonb: %w", err)
	}
	return b, nil
}

// lookupKey reads key's record outside any transaction: a committed record
// never changes (only its expiry deletes it), so no lock is needed to
// answer a replay from it.
func lookupKey(ctx context.Context, db db, key string) (*storedKey, error) {
	b := &pgx.Batch{}
	k := queueLookupKey(b, key)
	if err := db.SendBatch(ctx, b).Close(); err != nil {
		return nil, err
	}
	return k, nil
}

// queueDeleteKey queues the delete of key's record: an expired one, so the
// key can be used afresh.
func queueDeleteKey(b *pgx.Batch, key string) {
	b.Queue(`DELETE FROM idempotency_keys WHERE key = $1`, key)
}

// queueInsertKey queues the insert of key's record. response is stored as
// bytes (bytea), so a replay sends exactly what the first request got.
func queueInsertKey(b *pgx.Batch, key string, hash []byte, status int, response []byte, orderID uuid.UUID, ttl time.Duration) {
	b.Queue(`INSERT INTO idempotency_keys (key, request_hash, status_code, response, order_id, expires_at)
		VALUES ($1, $2, $3, $4, $5, now() + $6::bigint * interval '1 microsecond')`,
		key, hash, status, response, param(orderID), ttl.Microseconds())
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
