package order

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
)

const replayBody = `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":2}]}`

// A replay answers with the bytes of the first response, not an equal
// JSON document: a client may hash or sign what it got.
func TestReplayIsByteForByte(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	first := e.post(t, "bytes", replayBody)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	// The same request spelled differently, as well as the same bytes.
	for _, body := range []string{replayBody, `{ "items": [ {"quantity": 2, "sku": "SKU-1"} ], "customer_id": "c-1" }`} {
		again := e.post(t, "bytes", body)
		if again.status != first.status || again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("replay: %d %q", again.status, again.header.Get("Idempotent-Replayed"))
		}
		if !bytes.Equal(again.body, first.body) {
			t.Fatalf("replay body differs from the first response:\nfirst  %s\nreplay %s", first.body, again.body)
		}
	}
}

// Keys stored while responses were jsonb (before migration 00004) lost
// their bytes in the database; their replays still give the original
// bytes. The test puts the table back as 00003 left it, stores a key the
// way the code of then did, and migrates again.
func TestKeysStoredAsJSONBReplayByteForByte(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.stock(t, "SKU-1", 100)
	ctx := context.Background()
	up, down := migration(t, "00004_idempotency_response_bytes.sql")
	conn, err := pgx.Connect(ctx, e.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, down); err != nil {
		t.Fatalf("migrate down: %v", err)
	}

	// What the service answered then: json.Marshal of the new order, with
	// a customer id that jsonb and encoding/json escape differently.
	var req createRequest
	if err := json.Unmarshal([]byte(`{"customer_id":"<c&1>","items":[{"sku":"SKU-1","quantity":2}]}`), &req); err != nil {
		t.Fatal(err)
	}
	o, err := newOrder(req, map[string]int64{"SKU-1": 100})
	if err != nil {
		t.Fatal(err)
	}
	o.History[0].Reason = "a reason, so that omitempty is exercised"
	sent, err := json.Marshal(o)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO idempotency_keys (key, request_hash, status_code, response, order_id, expires_at)
		VALUES ('legacy', $1, 201, $2, $3, now() + interval '1 hour')`, req.hash(), sent, o.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, up); err != nil {
		t.Fatalf("migrate up: %v", err)
	}
	var stored []byte
	var normalized bool
	if err := conn.QueryRow(ctx, `SELECT response, response_normalized FROM idempotency_keys WHERE key = 'legacy'`).
		Scan(&stored, &normalized); err != nil {
		t.Fatal(err)
	}
	if !normalized || bytes.Equal(stored, sent) {
		t.Fatalf("the migrated row: normalized %v, bytes %s; want jsonb's text, marked", normalized, stored)
	}

	res := e.post(t, "legacy", `{"customer_id":"<c&1>","items":[{"sku":"SKU-1","quantity":2}]}`)
	if res.status != http.StatusCreated || res.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay of the old key: %d %s", res.status, res.body)
	}
	if !bytes.Equal(res.body, sent) {
		t.Fatalf("replay of a key stored as jsonb:\nsent   %s\nreplay %s", sent, res.body)
	}
	// A key stored after the migration is verbatim.
	if res := e.post(t, "new", replayBody); res.status != http.StatusCreated {
		t.Fatalf("new key: %d %s", res.status, res.body)
	}
	if n := e.count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'new' AND NOT response_normalized`); n != 1 {
		t.Fatal("a key stored after the migration is marked normalized")
	}
}

// migration returns the Up and Down sections of an order migration.
func migration(t *testing.T, name string) (up, down string) {
	t.Helper()
	b, err := os.ReadFile("../../migrations/order/" + name)
	if err != nil {
		t.Fatal(err)
	}
	up, down, ok := strings.Cut(string(b), "-- +goose Down")
	if !ok {
		t.Fatalf("%s has no Down section", name)
	}
	return strings.TrimPrefix(up, "-- +goose Up"), down
}

// While POST /orders sheds, a retry of an order that committed gets its
// stored response (byte for byte); a new key is still refused before
// anything is written, and a key reused with another body is still 422.
func TestReplayWhileShedding(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{MaxBacklog: 3})
	e.stock(t, "SKU-1", 100)
	first := e.post(t, "committed", replayBody)
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	e.lag(t, 5)
	tries := 0
	poll.Until(t, 15*time.Second, "POST /orders to be shed", func() bool { // the backlog is read every 200ms
		tries++
		return e.post(t, fmt.Sprint("new-", tries), replayBody).status == http.StatusServiceUnavailable
	})
	// Orders placed before the shedding began, and their keys.
	const written = `SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM idempotency_keys) + (SELECT count(*) FROM outbox)`
	before := e.count(t, written)

	again := e.post(t, "committed", replayBody)
	if again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay while shedding: %d %s", again.status, again.body)
	}
	if !bytes.Equal(again.body, first.body) {
		t.Fatalf("replay while shedding:\nfirst  %s\nreplay %s", first.body, again.body)
	}
	if res := e.post(t, "committed", strings.Replace(replayBody, `"quantity":2`, `"quantity":3`, 1)); res.status != http.StatusUnprocessableEntity {
		t.Fatalf("reused key while shedding: %d %s", res.status, res.body)
	}
	res := e.post(t, "fresh", replayBody)
	if res.status != http.StatusServiceUnavailable || res.header.Get("Retry-After") != "1" {
		t.Fatalf("new key while shedding: %d %s", res.status, res.body)
	}
	if n := e.count(t, written); n != before {
		t.Fatalf("requests while shedding wrote %d rows", n-before)
	}
	// An expired key is no record: shed like a new one.
	if _, err := e.pool.Exec(context.Background(), `UPDATE idempotency_keys SET expires_at = now() - interval '1s'`); err != nil {
		t.Fatal(err)
	}
	if res := e.post(t, "committed", replayBody); res.status != http.StatusServiceUnavailable {
		t.Fatalf("expired key while shedding: %d %s", res.status, res.body)
	}
}

// lag makes a consumer of ORDERS that has n events it never settles, so
// the saga's backlog reads n until the test ends.
func (e *env) lag(t *testing.T, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// A consumer of the saga (only those count for admission) that no
	// service of this test runs.
	if _, err := e.js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
		Durable: "payment-orders", AckPolicy: jetstream.AckExplicitPolicy,
	}); err != nil {
		t.Fatal(err)
	}
	for range n {
		natstest.Publish(t, e.js, nats.NewMsg("orders.x.Something"))
	}
}
