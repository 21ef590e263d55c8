package order

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/saga"
)

// createPlain is the transaction of POST /orders as the textbook writes
// it: one pgx transaction, a statement at a time, the order's event added
// with the outbox in the same transaction as the order. It is create,
// decision for decision; create sends the same statements in two round
// trips (BEGIN with the reads, the writes with COMMIT) instead of one
// each, which is what docs/performance.md measures. Read this one first.
func (s *Service) createPlain(ctx context.Context, key string, req createRequest) (reply, error) {
	hash := req.hash()
	var res reply
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// A twin request with this key in flight gets 409 at once; the
		// lock goes with the commit that makes the key's record visible.
		var locked bool
		if err := tx.QueryRow(ctx, keyLockSQL, key).Scan(&locked); err != nil {
			return fmt.Errorf("lock idempotency key: %w", err)
		}
		if !locked {
			return errInFlight
		}
		stored, err := lookupKey(ctx, tx, key)
		if err != nil {
			return err
		}
		if stored.found && !stored.expired {
			if string(stored.hash) != string(hash) {
				return errKeyReused
			}
			res = reply{status: stored.status, body: stored.response, replayed: true}
			return nil // a retry: the first answer, nothing written
		}
		prices := &pgx.Batch{}
		known := queuePrices(prices, req.skus())
		if err := tx.SendBatch(ctx, prices).Close(); err != nil {
			return err
		}
		o, err := newOrder(req, known)
		if err != nil {
			return err
		}
		res = reply{status: http.StatusCreated}
		if res.body, err = json.Marshal(o); err != nil {
			return fmt.Errorf("encode order: %w", err)
		}

		// The business rows…
		rows := &pgx.Batch{}
		queueInsertOrder(rows, o)
		if stored.expired {
			queueDeleteKey(rows, key)
		}
		queueInsertKey(rows, key, hash, res.status, res.body, o.ID, s.cfg.KeyTTL)
		if err := tx.SendBatch(ctx, rows).Close(); err != nil {
			return fmt.Errorf("create order %s: %w", o.ID, err)
		}
		// …the saga with its reservation deadline…
		reserveBy := saga.Timeout{Name: reservationTimeout, Due: o.CreatedAt.Add(s.cfg.ReservationTimeout)}
		if err := s.saga.Start(ctx, tx, o.ID.String(), Pending, nil, reserveBy); err != nil {
			return err
		}
		// …and the event, in the same transaction: committed together or
		// not at all.
		return s.outbox.Add(ctx, tx, orderCreated(o))
	})
	if err != nil {
		return reply{}, err
	}
	return res, nil
}

// The plain form and the pipelined one give every request the same answer
// and write the same rows: the textbook form is not a simplification of
// what the service does, only a slower spelling of it.
func TestPlainAndPipelinedCreateAgree(t *testing.T) {
	t.Parallel()
	type step struct{ key, body string }
	steps := []step{
		{"k-1", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2},{"sku":"SKU-2","quantity":1}]}`},
		{"k-1", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2},{"sku":"SKU-2","quantity":1}]}`}, // a retry
		{"k-1", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":3}]}`},                              // the key reused
		{"k-2", `{"customer_id":"c-2","items":[{"sku":"GHOST","quantity":1}]}`},                              // not in the catalogue
		{"k-3", `{"customer_id":"c-3","items":[{"sku":"SKU-2","quantity":4}]}`},
	}
	type outcome struct {
		status   int
		replayed bool
		problem  string
	}
	run := func(create func(*Service, context.Context, string, createRequest) (reply, error)) ([]outcome, map[string]int) {
		e := setup(t, Config{})
		e.stock(t, "SKU-1", 1999)
		e.stock(t, "SKU-2", 500)
		var got []outcome
		for _, st := range steps {
			var req createRequest
			if err := json.Unmarshal([]byte(st.body), &req); err != nil {
				t.Fatal(err)
			}
			res, err := create(e.svc, context.Background(), st.key, req)
			var p *httpx.Problem
			switch {
			case errors.As(err, &p):
				got = append(got, outcome{status: p.Status, problem: p.Code})
			case err != nil:
				t.Fatalf("%s: %v", st.key, err)
			default:
				got = append(got, outcome{status: res.status, replayed: res.replayed})
			}
		}
		rows := map[string]int{}
		for _, q := range []string{
			`SELECT count(*) FROM orders`, `SELECT count(*) FROM order_items`, `SELECT count(*) FROM order_history`,
			`SELECT count(*) FROM idempotency_keys`, `SELECT count(*) FROM saga_instances WHERE state = 'PENDING'`,
			`SELECT count(*) FROM saga_timeouts`, `SELECT count(*) FROM outbox WHERE event_type = 'OrderCreated'`,
			`SELECT count(DISTINCT aggregate_seq) FROM outbox WHERE event_type = 'OrderCreated'`,
		} {
			rows[q] = e.count(t, q)
		}
		return got, rows
	}
	plainOut, plainRows := run((*Service).createPlain)
	pipeOut, pipeRows := run((*Service).create)
	for i := range steps {
		if plainOut[i] != pipeOut[i] {
			t.Errorf("step %d (%s): plain %+v, pipelined %+v", i+1, steps[i].key, plainOut[i], pipeOut[i])
		}
	}
	for q, n := range plainRows {
		if pipeRows[q] != n {
			t.Errorf("%s: plain %d, pipelined %d", q, n, pipeRows[q])
		}
	}
	if plainRows[`SELECT count(*) FROM orders`] != 2 || plainOut[1] != (outcome{status: http.StatusCreated, replayed: true}) {
		t.Errorf("the steps did not do what they say: %+v, rows %v", plainOut, plainRows)
	}
}
