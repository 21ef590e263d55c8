package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Event is one fact to publish. The zero values of ID, SchemaVersion,
// OccurredAt and Subject are filled in by Add (or Queue).
type Event struct {
	ID            uuid.UUID         // stable forever; it becomes Nats-Msg-Id. Zero: a new UUIDv7.
	AggregateType string            // e.g. "order"
	AggregateID   string            // the order id; events of one aggregate are published in order
	Seq           int64             // the aggregate's sequence number; zero: Add takes the next one (see Add)
	Type          string            // e.g. "OrderCreated"
	SchemaVersion int               // payload schema version; zero means 1
	Subject       string            // e.g. "orders.<id>.OrderCreated"; empty: <Writer.Prefix>.<AggregateID>.<Type>
	Payload       any               // JSON snapshot; json.RawMessage and []byte are used as they are
	Headers       map[string]string // extra message headers, e.g. traceparent
	OccurredAt    time.Time         // zero means now
}

// DB is what the read and operator functions need: a *pgxpool.Pool, a
// *pgx.Conn or a pgx.Tx.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Writer adds events to the outbox. The zero value is ready to use.
type Writer struct {
	// Prefix, when set, makes the subject of an Event with an empty Subject
	// <Prefix>.<AggregateID>.<Type>; the three must then each be one subject
	// token (no dots, wildcards or whitespace), or the event is refused.
	// Empty: every Event must carry its Subject.
	Prefix string

	// NotifyInterval is the least time between two NOTIFYs (relay wake-ups)
	// sent by this process: NOTIFY takes a database-wide lock at commit,
	// and under heavy load one per interval is enough. Default 0: every
	// commit.
	NotifyInterval time.Duration

	lastNotify atomic.Int64 // unix nanoseconds
}

// Add writes events into the outbox inside tx, the caller's transaction, so
// that they commit or roll back with the business change they describe.
// Nothing is published before tx commits.
//
// When Seq is zero, Add takes the aggregate's next sequence number from its
// counter row, under that row's lock: two transactions on one aggregate take
// turns, and a rollback leaves no gap. A caller whose aggregate row carries
// a version, updated in tx under the same lock, may set Seq from it instead,
// for every event of that aggregate type. A sequence used twice fails on the
// outbox's unique key.
func (w *Writer) Add(ctx context.Context, tx pgx.Tx, events ...Event) error {
	b := &pgx.Batch{}
	if err := w.Queue(ctx, b, events...); err != nil {
		return err
	}
	if b.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("add events to outbox: %w", err)
	}
	return nil
}

// Queue queues the statements of [Writer.Add] for events into b, so that
// they cost no round trip of their own. Add's guarantees hold only if b is
// sent on the transaction that holds the business rows (tx.SendBatch).
// The trace context of ctx goes into each event's headers, unless the
// event's Headers carry a traceparent of their own.
//
// Queue returns the errors it can find without the database (an invalid
// event, a payload that does not encode) and then has queued nothing; the
// insert's own errors surface from the batch, and the caller rolls back.
func (w *Writer) Queue(ctx context.Context, b *pgx.Batch, events ...Event) error {
	if len(events) == 0 {
		return nil
	}
	groups, err := groupByAggregate(w.Prefix, traceHeaders(ctx), events)
	if err != nil {
		return err
	}
	var counted []*group
	for _, g := range groups {
		if g.givenSeq {
			b.Queue(insertGivenSQL, g.aggType, g.aggID, g.seqs, g.ids, g.types, g.versions, g.subjects, g.payloads, g.headers, g.occurred)
			continue
		}
		counted = append(counted, g)
	}
	switch {
	case len(counted) == 1:
		g := counted[0]
		b.Queue(insertSQL, g.aggType, g.aggID, len(g.ids), g.ids, g.types, g.versions, g.subjects, g.payloads, g.headers, g.occurred)
	case len(counted) > 1:
		// One statement for many aggregates (a consumer's batch writes an
		// event for each of its orders): a statement each cost most of the
		// write of such a batch.
		queueMany(b, counted)
	}
	if w.shouldNotify() {
		// Delivered by Postgres only when the transaction commits: a
		// wake-up for exactly the moment the events become visible.
		b.Queue(notifySQL)
	}
	return nil
}

func (w *Writer) shouldNotify() bool {
	if w.NotifyInterval <= 0 {
		return true
	}
	now := time.Now().UnixNano()
	last := w.lastNotify.Load()
	return now-last >= int64(w.NotifyInterval) && w.lastNotify.CompareAndSwap(last, now)
}

const insertSQL = `
WITH seq AS (
	INSERT INTO outbox_sequences (aggregate_type, aggregate_id, last_seq)
	VALUES ($1, $2, $3)
	ON CONFLICT (aggregate_type, aggregate_id)
	DO UPDATE SET last_seq = outbox_sequences.last_seq + EXCLUDED.last_seq
	RETURNING last_seq
)
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                    schema_version, subject, payload, headers, occurred_at)
SELECT e.id, $1, $2, seq.last_seq - $3 + e.n, e.typ, e.ver, e.subj, e.payload::json, e.headers::jsonb, e.at
FROM seq, unnest($4::uuid[], $5::text[], $6::int[], $7::text[], $8::text[], $9::text[], $10::timestamptz[])
     WITH ORDINALITY AS e(id, typ, ver, subj, payload, headers, at, n)`

const insertGivenSQL = `
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                    schema_version, subject, payload, headers, occurred_at)
SELECT e.id, $1, $2, e.seq, e.typ, e.ver, e.subj, e.payload::json, e.headers::jsonb, e.at
FROM unnest($3::bigint[], $4::uuid[], $5::text[], $6::int[], $7::text[], $8::text[], $9::text[], $10::timestamptz[])
     AS e(seq, id, typ, ver, subj, payload, headers, at)`

// insertManySQL is insertSQL for several aggregates at once. Their counter
// rows are upserted in the order given, which is groupByAggregate's fixed
// aggregate order, so two transactions still lock them in one order.
const insertManySQL = `
WITH seq AS (
	INSERT INTO outbox_sequences (aggregate_type, aggregate_id, last_seq)
	SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])
	ON CONFLICT (aggregate_type, aggregate_id)
	DO UPDATE SET last_seq = outbox_sequences.last_seq + EXCLUDED.last_seq
	RETURNING aggregate_type, aggregate_id, last_seq
)
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
                    schema_version, subject, payload, headers, occurred_at)
SELECT e.id, e.agg_type, e.agg_id, seq.last_seq - e.cnt + e.k, e.typ, e.ver, e.subj, e.payload::json, e.headers::jsonb, e.at
FROM unnest($4::text[], $5::text[], $6::bigint[], $7::bigint[], $8::uuid[], $9::text[], $10::int[], $11::text[], $12::text[], $13::text[], $14::timestamptz[])
     WITH ORDINALITY AS e(agg_type, agg_id, k, cnt, id, typ, ver, subj, payload, headers, at, ord)
JOIN seq ON seq.aggregate_type = e.agg_type AND seq.aggregate_id = e.agg_id
ORDER BY e.ord`

// queueMany queues insertManySQL for groups, none of them numbered by the
// caller.
func queueMany(b *pgx.Batch, groups []*group) {
	var (
		aggTypes, aggIDs                                 []string
		counts                                           []int64
		eTypes, eIDs, types, subjects, payloads, headers []string
		ks, cnts                                         []int64
		ids                                              []uuid.UUID
		versions                                         []int32
		occurred                                         []time.Time
	)
	for _, g := range groups {
		n := int64(len(g.ids))
		aggTypes, aggIDs, counts = append(aggTypes, g.aggType), append(aggIDs, g.aggID), append(counts, n)
		for i := range g.ids {
			eTypes, eIDs = append(eTypes, g.aggType), append(eIDs, g.aggID)
			ks, cnts = append(ks, int64(i+1)), append(cnts, n)
		}
		ids = append(ids, g.ids...)
		types = append(types, g.types...)
		versions = append(versions, g.versions...)
		subjects = append(subjects, g.subjects...)
		payloads = append(payloads, g.payloads...)
		headers = append(headers, g.headers...)
		occurred = append(occurred, g.occurred...)
	}
	b.Queue(insertManySQL, aggTypes, aggIDs, counts,
		eTypes, eIDs, ks, cnts, ids, types, versions, subjects, payloads, headers, occurred)
}

// The channel is per schema, so relays of one service wake only for it.
const notifySQL = `SELECT pg_notify('outbox.' || current_schema(), '')`

type group struct {
	aggType, aggID    string
	givenSeq          bool    // the caller numbered these events
	seqs              []int64 // their numbers when givenSeq
	ids               []uuid.UUID
	types, subjects   []string
	payloads, headers []string
	versions          []int32
	occurred          []time.Time
}

func groupByAggregate(prefix string, trace map[string]string, events []Event) ([]*group, error) {
	byKey := map[[2]string]*group{}
	var groups []*group
	now := time.Now()
	for i, e := range events {
		if err := e.validate(); err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
		subject, err := e.subject(prefix)
		if err != nil {
			return nil, fmt.Errorf("event %d (%s): %w", i, e.Type, err)
		}
		payload, err := encodePayload(e.Payload)
		if err != nil {
			return nil, fmt.Errorf("event %d (%s): %w", i, e.Type, err)
		}
		headers, err := json.Marshal(withTrace(e.Headers, trace))
		if err != nil {
			return nil, fmt.Errorf("event %d (%s) headers: %w", i, e.Type, err)
		}
		id := e.ID
		if id == uuid.Nil {
			if id, err = uuid.NewV7(); err != nil {
				return nil, fmt.Errorf("new event id: %w", err)
			}
		}
		occurred := e.OccurredAt
		if occurred.IsZero() {
			occurred = now
		}
		key := [2]string{e.AggregateType, e.AggregateID}
		g := byKey[key]
		if g == nil {
			g = &group{aggType: e.AggregateType, aggID: e.AggregateID}
			byKey[key] = g
			groups = append(groups, g)
		}
		if len(g.ids) == 0 {
			g.givenSeq = e.Seq > 0
		} else if g.givenSeq != (e.Seq > 0) {
			return nil, fmt.Errorf("event %d: %w: events of aggregate %s/%s mix given and counted sequences",
				i, ErrInvalidEvent, e.AggregateType, e.AggregateID)
		}
		if g.givenSeq {
			g.seqs = append(g.seqs, e.Seq)
		}
		g.ids = append(g.ids, id)
		g.types = append(g.types, e.Type)
		g.versions = append(g.versions, int32(max(e.SchemaVersion, 1)))
		g.subjects = append(g.subjects, subject)
		g.payloads = append(g.payloads, string(payload))
		g.headers = append(g.headers, string(headers))
		g.occurred = append(g.occurred, occurred)
	}
	slices.SortFunc(groups, func(a, b *group) int {
		return cmp.Or(cmp.Compare(a.aggType, b.aggType), cmp.Compare(a.aggID, b.aggID))
	})
	return groups, nil
}

func (e Event) validate() error {
	switch {
	case e.AggregateType == "":
		return fmt.Errorf("%w: no aggregate type", ErrInvalidEvent)
	case e.AggregateID == "":
		return fmt.Errorf("%w: no aggregate id", ErrInvalidEvent)
	case e.Type == "":
		return fmt.Errorf("%w: no event type", ErrInvalidEvent)
	case e.Seq < 0:
		return fmt.Errorf("%w: negative sequence", ErrInvalidEvent)
	case e.SchemaVersion < 0:
		return fmt.Errorf("%w: negative schema version", ErrInvalidEvent)
	}
	return nil
}

// subject is the event's own Subject, or else the writer's subject rule
// <prefix>.<aggregate id>.<type>. A made subject must have exactly three
// parts: an id with a dot in it would publish on a subject that the
// consumers' filters (<prefix>.*.<type>, say) never match, and the event
// would be lost to them without a word.
func (e Event) subject(prefix string) (string, error) {
	if e.Subject != "" {
		return e.Subject, nil
	}
	if prefix == "" {
		return "", fmt.Errorf("%w: no subject, and the writer has no Prefix to make one (set Writer.Prefix or Event.Subject)", ErrInvalidEvent)
	}
	for _, part := range []struct{ what, s string }{{"writer prefix", prefix}, {"aggregate id", e.AggregateID}, {"event type", e.Type}} {
		if strings.ContainsAny(part.s, ".*> \t\r\n") {
			return "", fmt.Errorf("%w: %s %q cannot be a token of the subject <prefix>.<aggregate id>.<type>", ErrInvalidEvent, part.what, part.s)
		}
	}
	return prefix + "." + e.AggregateID + "." + e.Type, nil
}

func encodePayload(p any) ([]byte, error) {
	var b []byte
	switch v := p.(type) {
	case nil:
		return nil, fmt.Errorf("%w: no payload", ErrInvalidEvent)
	case json.RawMessage:
		b = v
	case []byte:
		b = v
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			return nil, fmt.Errorf("encode payload: %w", err)
		}
	}
	if !json.Valid(b) {
		return nil, fmt.Errorf("%w: payload is not JSON", ErrInvalidEvent)
	}
	return b, nil
}
