package journey

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// loadSaga reads the order's status, its history, the events its saga
// ignored and its armed timeouts from the order schema.
func loadSaga(ctx context.Context, db DB, id uuid.UUID, j *Journey) error {
	err := db.QueryRow(ctx, `SELECT status FROM orders WHERE order_id = $1`, id).Scan(&j.Status)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("journey: read order %s: %w", id, err)
	}
	rows, err := db.Query(ctx, `SELECT status, at, coalesce(reason, '') FROM order_history
		WHERE order_id = $1 ORDER BY id`, id)
	if err != nil {
		return fmt.Errorf("journey: read history of %s: %w", id, err)
	}
	var (
		status, reason, prev string
		at                   time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&status, &at, &reason}, func() error {
		what := "state " + status
		switch {
		case prev == status:
			what = "state " + status + " stays"
		case prev != "":
			what = "state " + prev + " → " + status
		}
		if reason != "" {
			what += " (" + reason + ")"
		}
		j.Entries = append(j.Entries, Entry{At: at, Kind: State, Service: "order", State: status, What: what})
		prev = status
		return nil
	})
	if err != nil {
		return fmt.Errorf("journey: read history of %s: %w", id, err)
	}

	rows, err = db.Query(ctx, `SELECT coalesce(state, ''), event_type, coalesce(event_id, ''), recorded_at
		FROM saga_unexpected WHERE saga_id = $1 ORDER BY id`, id.String())
	if err != nil {
		return fmt.Errorf("journey: read the saga's unexpected events of %s: %w", id, err)
	}
	var typ, eventID string
	_, err = pgx.ForEachRow(rows, []any{&status, &typ, &eventID, &at}, func() error {
		what := "saga ignored " + typ + " in state " + status + " (no transition)"
		if status == "" {
			what = "saga ignored " + typ + ": no saga instance"
		}
		j.Entries = append(j.Entries, Entry{At: at, Kind: Unexpected, Service: "order", EventType: typ,
			EventID: eventID, State: status, What: what})
		return nil
	})
	if err != nil {
		return fmt.Errorf("journey: read the saga's unexpected events of %s: %w", id, err)
	}

	rows, err = db.Query(ctx, `SELECT name, due_at FROM saga_timeouts WHERE saga_id = $1 ORDER BY due_at, name`, id.String())
	if err != nil {
		return fmt.Errorf("journey: read the saga's timeouts of %s: %w", id, err)
	}
	j.Timeouts, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Timeout])
	if err != nil {
		return fmt.Errorf("journey: read the saga's timeouts of %s: %w", id, err)
	}
	return nil
}
