package payment

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/proof/streamtest"
)

// The size of a batch changes nothing the handler does: it queues the
// intent statements of a batch and sends what it queued before a refund's
// read, which must leave what a batch of one leaves. Random histories of
// ORDERS events, applied one event per transaction on one schema and in
// batches of random sizes on another, leave the same intents (trace
// headers included) and refunds.
func TestBatchSizeChangesNoIntent(t *testing.T) {
	t.Parallel()
	streamtest.Seeds(t, 4, func(t *testing.T, rng *rand.Rand) {
		alone, batched := newEnv(t), newEnv(t)
		stream := paymentHistory(t, rng, 50, alone, batched)
		ctx := context.Background()
		for _, m := range stream {
			if err := inTx(ctx, alone, func(tx pgx.Tx) error {
				return alone.svc.handle(ctx, tx, []inbox.Batched{{Message: m, Ctx: orderCtx(m.AggregateID)}})
			}); err != nil {
				t.Fatalf("%s %s: %v", m.Type, m.AggregateID, err)
			}
		}
		for _, msgs := range streamtest.Batches(t, rng, stream, 20) {
			batch := make([]inbox.Batched, len(msgs))
			for i, m := range msgs {
				batch[i] = inbox.Batched{Message: m, Ctx: orderCtx(m.AggregateID)}
			}
			if err := inTx(ctx, batched, func(tx pgx.Tx) error { return batched.svc.handle(ctx, tx, batch) }); err != nil {
				t.Fatalf("a batch of %d: %v", len(batch), err)
			}
		}
		a, b := alone.paymentSnapshot(t), batched.paymentSnapshot(t)
		if a != b {
			t.Errorf("one at a time and in batches differ:\n--- one at a time\n%s\n--- in batches\n%s", a, b)
		}
		for _, want := range []string{"PAYABLE", "PAID", "CLOSED", "REQUESTED", "traceparent", "announced true", "2030-01-01"} {
			if !strings.Contains(a, want) {
				t.Errorf("the history never reached %s", want)
			}
		}
	})
}

// paymentHistory is a random ORDERS stream: each order follows one of a few
// scripts, the orders interleaved. An order that asks for a refund has a
// succeeded payment, written into both envs first.
func paymentHistory(t *testing.T, rng *rand.Rand, orders int, envs ...*env) []inbox.Message {
	t.Helper()
	scripts := [][]string{
		{"OrderCreated", "OrderAwaitingPayment", "OrderPaid"},
		{"OrderCreated", "OrderAwaitingPayment", "OrderClosed"},
		{"OrderCreated", "OrderRejected"},
		{"OrderCreated", "OrderAwaitingPayment"},
		{"OrderCreated"},
		{"OrderAwaitingPayment", "OrderCreated", "OrderPaid"},
		{"OrderClosed", "OrderCreated"},
		{"OrderCreated", "OrderAwaitingPayment", "OrderClosed", typeRefundRequested},
		{"OrderCreated", "OrderAwaitingPayment", "OrderPaid", typeRefundRequested, typeRefundRequested},
	}
	var queues [][]inbox.Message
	for i := range orders {
		orderID := fmt.Sprintf("order-%03d", i)
		total := int64(100 + rng.IntN(900))
		paymentID := uuid.New()
		script := scripts[rng.IntN(len(scripts))]
		if slices.Contains(script, typeRefundRequested) {
			for _, e := range envs {
				if _, err := e.db.Pool.Exec(context.Background(), `
					INSERT INTO payments (payment_id, order_id, provider_payment_id, status, amount, created_at)
					VALUES ($1, $2, $3, $4, $5, now())`, paymentID, orderID, "p-"+orderID, StatusSucceeded, total); err != nil {
					t.Fatal(err)
				}
			}
		}
		var q []inbox.Message
		for seq, typ := range script {
			payload := map[string]any{"order_id": orderID, "total": total, "amount": total,
				"payment_id": paymentID.String(), "reason": "late",
				"pay_by": time.Date(2030, 1, 1, 0, 0, i, 0, time.UTC).Format(time.RFC3339Nano)}
			data, err := json.Marshal(payload)
			if err != nil {
				t.Fatal(err)
			}
			q = append(q, inbox.Message{EventID: uuid.New(), Type: typ, AggregateType: "order", AggregateID: orderID,
				Seq: int64(seq + 1), SchemaVersion: 1, Subject: "orders." + orderID + "." + typ, Data: data})
		}
		queues = append(queues, q)
	}
	return streamtest.Interleave(rng, queues)
}

// orderCtx is a context whose span is the order's own, as if each order
// were a trace of its own.
func orderCtx(orderID string) context.Context {
	sum := sha256.Sum256([]byte(orderID))
	return trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID(sum[:16]), SpanID: trace.SpanID(sum[16:24]), TraceFlags: trace.FlagsSampled,
	}))
}

// paymentSnapshot is the intents, their announcements and the refunds as
// text (intent and refund ids are new on each side; the refunds'
// idempotency keys, the event ids, are not).
func (e *env) paymentSnapshot(t *testing.T) string {
	t.Helper()
	return e.db.Dump(t,
		`SELECT order_id, state, amount, pay_by, trace_headers FROM intents ORDER BY order_id`,
		`SELECT i.order_id, o.aggregate_seq, o.payload->>'amount', 'announced ' || (o.payload->>'intent_id' = i.intent_id::text)
		 FROM intents i JOIN outbox o ON o.aggregate_id = i.order_id AND o.event_type = 'PaymentOpened' ORDER BY 1`,
		`SELECT order_id, payment_id, idempotency_key, amount, state FROM refunds ORDER BY order_id, idempotency_key`)
}

// inTx runs f in a transaction on e's pool, as the inbox would, and
// commits.
func inTx(ctx context.Context, e *env, f func(pgx.Tx) error) error {
	tx, err := e.db.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}
