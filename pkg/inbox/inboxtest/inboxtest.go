// Package inboxtest helps the tests of code that consumes events with
// pkg/inbox: assert that a consumer processed an event (its handler's
// transaction committed, so a redelivery will be absorbed), without
// knowing the inbox's tables.
//
//	inboxtest.RequireProcessed(t, pool, "payment-orders", eventID)
//
// The db argument is anything that reads the inbox's schema: a
// *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
package inboxtest

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
)

// Processed returns the ids of the events consumer has processed (its
// handler committed, or the event was of a type it does not handle), in
// no particular order; events older than the consumer's Retention may have
// been forgotten. It fails t if the inbox cannot be read.
func Processed(t testing.TB, db inbox.DB, consumer string) []uuid.UUID {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT event_id FROM processed_events WHERE consumer_name = $1`, consumer)
	if err != nil {
		t.Fatalf("inboxtest: read the inbox: %v", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		t.Fatalf("inboxtest: read the inbox: %v", err)
	}
	return ids
}

// RequireProcessed fails t unless consumer has processed the event.
func RequireProcessed(t testing.TB, db inbox.DB, consumer string, eventID uuid.UUID) {
	t.Helper()
	if !processed(t, db, consumer, eventID) {
		t.Fatalf("inboxtest: %s has not processed event %s", consumer, eventID)
	}
}

// RequireNotProcessed fails t if consumer has processed the event.
func RequireNotProcessed(t testing.TB, db inbox.DB, consumer string, eventID uuid.UUID) {
	t.Helper()
	if processed(t, db, consumer, eventID) {
		t.Fatalf("inboxtest: %s has processed event %s, want not", consumer, eventID)
	}
}

func processed(t testing.TB, db inbox.DB, consumer string, eventID uuid.UUID) bool {
	t.Helper()
	var ok bool
	err := db.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM processed_events WHERE consumer_name = $1 AND event_id = $2)`, consumer, eventID).Scan(&ok)
	if err != nil {
		t.Fatalf("inboxtest: read the inbox: %v", err)
	}
	return ok
}

// LastSeq returns the last sequence of the aggregate that consumer has
// applied, 0 when none: events of one aggregate are applied in sequence
// order, so every event up to it is processed. source is the producer, the
// first token of the events' subjects ("orders" for orders.<id>.<Type>).
func LastSeq(t testing.TB, db inbox.DB, consumer, source, aggregateType, aggregateID string) int64 {
	t.Helper()
	var seq int64
	err := db.QueryRow(context.Background(), `SELECT coalesce(max(last_seq), 0) FROM inbox_sequences
		WHERE consumer_name = $1 AND source = $2 AND aggregate_type = $3 AND aggregate_id = $4`,
		consumer, source, aggregateType, aggregateID).Scan(&seq)
	if err != nil {
		t.Fatalf("inboxtest: read the inbox's sequences: %v", err)
	}
	return seq
}
