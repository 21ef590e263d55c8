package order

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/pgtest"
)

// noJetStream satisfies New's check. POST /orders never publishes (the
// event goes through the outbox), so a call on it would panic and show up.
type noJetStream struct{ jetstream.JetStream }

// FuzzOrderRequest drives the real POST /orders handler, against its own
// schema, with arbitrary bodies, Idempotency-Key headers and content types.
// It must never panic or answer anything but 201 or a problem+json refusal
// with 400, 413, 415 or 422; a refusal and a replay write nothing; a new
// order writes exactly one order, one OrderCreated, one saga instance and
// one key, and its total is the catalogue prices times the quantities.
//
//	go test -run '^$' -fuzz FuzzOrderRequest -fuzztime 60s ./services/order/
func FuzzOrderRequest(f *testing.F) {
	db := pgtest.New(f, Registration.Sets()...)
	ctx := context.Background()
	catalogue := map[string]int64{"SKU-1": 1999, "SKU-2": 500, "FREE": 0, "BIG": math.MaxInt64/2 + 1}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for sku, price := range catalogue {
			if err := upsertProduct(ctx, tx, sku, price, 1); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		f.Fatal(err)
	}
	svc, err := New(registry.Deps{Pool: db.Pool, JetStream: noJetStream{}}, Config{})
	if err != nil {
		f.Fatal(err)
	}
	r := chi.NewRouter()
	svc.Routes(r)

	f.Add([]byte(`{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2}]}`), "k-1", "application/json")
	f.Add(bytes.Repeat([]byte(" "), httpx.MaxBody+1), "k-big", "application/json")
	f.Add([]byte(`{"customer_id":"c-1","items":[{"sku":"BIG","quantity":2}]}`), "k-overflow", "application/json")

	type tally struct{ orders, items, history, outbox, keys, sagas int }
	counts := func(t *testing.T) (c tally) {
		if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM order_items),
			(SELECT count(*) FROM order_history), (SELECT count(*) FROM outbox),
			(SELECT count(*) FROM idempotency_keys), (SELECT count(*) FROM saga_instances)`).
			Scan(&c.orders, &c.items, &c.history, &c.outbox, &c.keys, &c.sagas); err != nil {
			t.Fatal(err)
		}
		return c
	}

	f.Fuzz(func(t *testing.T, body []byte, key, contentType string) {
		req := httptest.NewRequest(http.MethodPost, "/orders", bytes.NewReader(body))
		req.Header.Set("Content-Type", contentType)
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		before := counts(t)
		rec := httptest.NewRecorder()
		r.ServeHTTP(rec, req)
		after := counts(t)

		if rec.Code == http.StatusCreated {
			var o Order
			if err := json.Unmarshal(rec.Body.Bytes(), &o); err != nil || o.Status != Pending || len(o.Items) == 0 {
				t.Fatalf("201 with body %s (%v)", rec.Body, err)
			}
			var total int64
			for _, it := range o.Items {
				if it.UnitPrice != catalogue[it.SKU] || it.Quantity < 1 || it.Quantity > maxQuantity {
					t.Fatalf("201 with line %+v", it)
				}
				total += it.UnitPrice * int64(it.Quantity)
			}
			if total != o.Total || o.Total < 0 {
				t.Fatalf("201 with total %d, lines sum to %d", o.Total, total)
			}
			want := tally{before.orders + 1, before.items + len(o.Items), before.history + 1, before.outbox + 1, before.keys + 1, before.sagas + 1}
			if rec.Header().Get("Idempotent-Replayed") == "true" {
				want = before
			}
			if after != want {
				t.Fatalf("201 (replayed %q) wrote %+v -> %+v, want %+v", rec.Header().Get("Idempotent-Replayed"), before, after, want)
			}
			return
		}
		switch rec.Code {
		case http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType, http.StatusUnprocessableEntity:
		default:
			t.Fatalf("status %d for body %q, key %q, content type %q: %s", rec.Code, body, key, contentType, rec.Body)
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
			t.Fatalf("refusal %d with Content-Type %q", rec.Code, ct)
		}
		var p httpx.Problem
		if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil || p.Status != rec.Code || p.Code == "" ||
			!strings.HasPrefix(p.Type, "https://shop.example/problems/") {
			t.Fatalf("refusal %d is not a problem: %s", rec.Code, rec.Body)
		}
		if after != before {
			t.Fatalf("refusal %d (%s) wrote: %+v -> %+v", rec.Code, p.Code, before, after)
		}
	})
}
