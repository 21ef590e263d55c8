package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
)

// Parked is an event waiting in the parking lot for an earlier event of
// its aggregate, as an operator sees it.
type Parked struct {
	Consumer      string
	Source        string // the producer: the first token of the subject
	AggregateType string
	AggregateID   string
	Seq           int64
	EventID       uuid.UUID
	Stream        string
	StreamSeq     uint64
	Subject       string
	Header        nats.Header
	Data          []byte
	ParkedAt      time.Time
	WaitsFor      int64 // the sequence its aggregate needs next (its cursor + 1)
}

// ParkedStats counts the open parked events of consumer ("" for every
// consumer) and gives the time the oldest was parked (zero when none).
func ParkedStats(ctx context.Context, db DB, consumer string) (n int64, oldest time.Time, err error) {
	var at *time.Time
	err = db.QueryRow(ctx, `SELECT count(*), min(parked_at) FROM inbox_parked
		WHERE discarded_at IS NULL AND ($1 = '' OR consumer_name = $1)`, consumer).Scan(&n, &at)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("count parked events: %w", err)
	}
	if at != nil {
		oldest = *at
	}
	return n, oldest, nil
}

// ListParked returns up to limit (default 100) open parked events of
// consumer ("" for every consumer), oldest first.
func ListParked(ctx context.Context, db DB, consumer string, limit int) ([]Parked, error) {
	if limit <= 0 {
		limit = 100
	}
	rows, err := db.Query(ctx, `
		SELECT p.consumer_name, p.source, p.aggregate_type, p.aggregate_id, p.aggregate_seq, p.event_id,
		       p.stream, p.stream_seq, p.subject, p.headers, p.payload, p.parked_at, coalesce(s.last_seq, 0) + 1
		FROM inbox_parked p
		LEFT JOIN inbox_sequences s USING (consumer_name, source, aggregate_type, aggregate_id)
		WHERE p.discarded_at IS NULL AND ($1 = '' OR p.consumer_name = $1)
		ORDER BY p.parked_at
		LIMIT $2`, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("list parked events: %w", err)
	}
	defer rows.Close()
	var out []Parked
	for rows.Next() {
		var (
			p       Parked
			seq     int64
			headers []byte
		)
		if err := rows.Scan(&p.Consumer, &p.Source, &p.AggregateType, &p.AggregateID, &p.Seq, &p.EventID,
			&p.Stream, &seq, &p.Subject, &headers, &p.Data, &p.ParkedAt, &p.WaitsFor); err != nil {
			return nil, fmt.Errorf("scan parked event: %w", err)
		}
		p.StreamSeq = uint64(seq)
		if err := json.Unmarshal(headers, &p.Header); err != nil {
			return nil, fmt.Errorf("parked event %s headers: %w", p.EventID, err)
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list parked events: %w", err)
	}
	return out, nil
}

// DiscardParked drops the open parked event eventID of consumer, keeping
// the row for audit; its aggregate still waits for the missing event.
func DiscardParked(ctx context.Context, db DB, consumer string, eventID uuid.UUID, reason string) error {
	if reason == "" {
		return errors.New("inbox: a discard needs a reason")
	}
	tag, err := db.Exec(ctx, `UPDATE inbox_parked SET discarded_at = now(), discard_reason = $3
		WHERE consumer_name = $1 AND event_id = $2 AND discarded_at IS NULL`, consumer, eventID, reason)
	if err != nil {
		return fmt.Errorf("discard parked event %s: %w", eventID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("discard parked event %s of %s: %w", eventID, consumer, ErrNotFound)
	}
	return nil
}
