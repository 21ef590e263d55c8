// Package outboxtest helps the tests of code that writes events with
// pkg/outbox: assert what a transaction wrote to the outbox, before or
// after it commits, without knowing the outbox's tables.
//
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		if err := svc.CreateOrder(ctx, tx, order); err != nil {
//			return err
//		}
//		outboxtest.RequireWritten(t, tx, outboxtest.Want{AggregateID: order.ID, Type: "OrderCreated"})
//		return nil
//	})
//
// The db argument is anything that reads the outbox's schema: a pgx.Tx
// (which sees its own uncommitted events), a *pgxpool.Pool or a *pgx.Conn.
package outboxtest

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/outbox"
)

// Want selects events; an empty field matches any value.
type Want struct {
	AggregateType string
	AggregateID   string
	Type          string
}

func (w Want) String() string {
	return fmt.Sprintf("aggregate type %q, aggregate %q, type %q", w.AggregateType, w.AggregateID, w.Type)
}

// Written returns every event in the outbox that want selects, published or
// not, ordered by aggregate type, aggregate and sequence. It fails t if the
// outbox cannot be read.
func Written(t testing.TB, db outbox.DB, want Want) []outbox.Record {
	t.Helper()
	ctx := context.Background()
	rows, err := db.Query(ctx, `SELECT event_id FROM outbox
		WHERE ($1 = '' OR aggregate_type = $1) AND ($2 = '' OR aggregate_id = $2) AND ($3 = '' OR event_type = $3)
		ORDER BY aggregate_type, aggregate_id, aggregate_seq`, want.AggregateType, want.AggregateID, want.Type)
	if err != nil {
		t.Fatalf("outboxtest: read the outbox: %v", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		t.Fatalf("outboxtest: read the outbox: %v", err)
	}
	recs := make([]outbox.Record, 0, len(ids))
	for _, id := range ids {
		rec, err := outbox.Get(ctx, db, id)
		if err != nil {
			t.Fatalf("outboxtest: read event %s: %v", id, err)
		}
		recs = append(recs, rec)
	}
	return recs
}

// RequireWritten fails t unless exactly one event that want selects is in
// the outbox, and returns it.
func RequireWritten(t testing.TB, db outbox.DB, want Want) outbox.Record {
	t.Helper()
	recs := Written(t, db, want)
	if len(recs) != 1 {
		t.Fatalf("outboxtest: %d events written with %s, want 1%s", len(recs), want, list(recs))
	}
	return recs[0]
}

// RequireNotWritten fails t if any event that want selects is in the outbox.
func RequireNotWritten(t testing.TB, db outbox.DB, want Want) {
	t.Helper()
	if recs := Written(t, db, want); len(recs) != 0 {
		t.Fatalf("outboxtest: %d events written with %s, want none%s", len(recs), want, list(recs))
	}
}

func list(recs []outbox.Record) string {
	s := ""
	for i, r := range recs {
		if i == 5 {
			return s + fmt.Sprintf("\n\t… and %d more", len(recs)-5)
		}
		s += fmt.Sprintf("\n\t%s/%s #%d %s", r.AggregateType, r.AggregateID, r.Seq, r.Type)
	}
	return s
}
