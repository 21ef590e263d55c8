package verify

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/registry"
)

// Lost is an event that its outbox marked published and that its service's
// stream no longer holds: the broker acknowledged it and lost it later (an
// OS crash before its fsync, a disk), or someone deleted it.
type Lost struct {
	Service       string // the producer: order, inventory, …
	Stream        string
	EventID       uuid.UUID
	Type          string
	AggregateType string
	AggregateID   string
	Seq           int64
	PublishedAt   time.Time
}

func (l Lost) String() string {
	return fmt.Sprintf("%s: %s %s (%s %s, seq %d), marked published %s, is not in stream %s",
		l.Service, l.Type, l.EventID, l.AggregateType, l.AggregateID, l.Seq, l.PublishedAt.UTC().Format(time.RFC3339), l.Stream)
}

// StreamAudit is what AuditStreams found in one service's stream.
type StreamAudit struct {
	Service, Stream string
	Published       int    // events the outbox marked published in the window: those looked for
	Older           int    // published in the window too, but beyond AuditConfig.Newest: not looked for
	Scanned         int    // stream messages read
	Lost            []Lost // in aggregate and sequence order
	// Err, when set, says why the stream could not be read (NATS
	// unreachable, no such stream): nothing of it was audited, which is
	// not a pass.
	Err error
}

// AuditConfig bounds AuditStreams. Zero fields take the defaults beside them.
type AuditConfig struct {
	// Window: events marked published within it are looked for; the
	// relay's outbox retention, after which the rows are gone. Required.
	Window time.Duration
	// Grace leaves out the events marked published in its last stretch;
	// default 5s. The audit needs none for itself: it reads the outbox
	// before it asks the stream for its last sequence, so every event
	// marked published before that read was stored before it. But a
	// cluster's new stream leader applies committed messages to its store
	// after it takes over, and the newest messages are the ones a reader
	// can miss then.
	Grace time.Duration
	// Services to audit, by name; default every service of the shop.
	Services []string
	// Newest, when positive, looks only for the newest this many events
	// of each service (by published_at), bounding what one audit reads and
	// holds whatever the traffic; the rest of the window is counted in
	// StreamAudit.Older. Default 0: every event in the window.
	Newest int
}

// clockSkew is how far the stream scan starts before the earliest
// occurred_at of the window: occurred_at is the database's clock, a
// message's time in the stream the broker's. A database clock further
// ahead than this would make the first messages of the window look lost.
const clockSkew = time.Minute

// AuditStreams compares, for each service, the events its outbox marked
// published within cfg.Window (less cfg.Grace) with the messages its stream
// holds: every one of them must still be there under its Nats-Msg-Id.
// This is invariant 3 seen from the broker: the consumers' inboxes (Run's
// delivery check) only tell what reached them, and a relay never
// republishes an event it saw acknowledged.
//
// What it reads, per service: the window's outbox rows (event id,
// aggregate, sequence; by the partial index on published_at; the newest
// cfg.Newest when that is set) into memory, about 100 bytes each; then one
// pass over the stream in sequence order, by direct get in batches (scan:
// it creates nothing on the server), from the window's earliest
// occurred_at (less a minute for the clocks of database and broker) up to
// the stream's last sequence, stopping early once every event was found.
// Its cost grows with the messages stored since the window began
// (republished copies included), not with the number of subjects: on the
// development machine about 0.2 s per 10,000 events of 1 KiB and 2.1 s
// per 100,000, outbox read included, two to three times what the ordered
// consumer it replaced took (docs/performance.md, "Auditing the streams").
// A database error stops it; a stream that cannot be read is reported in
// that service's StreamAudit.Err.
func AuditStreams(ctx context.Context, shop Shop, js jetstream.JetStream, cfg AuditConfig) ([]StreamAudit, error) {
	if cfg.Window <= 0 {
		return nil, errors.New("audit streams: no window (the outbox retention)")
	}
	cfg.Grace = cmp.Or(cfg.Grace, 5*time.Second)
	names := cfg.Services
	if len(names) == 0 {
		names = shop.Services.Names()
	}
	out := make([]StreamAudit, 0, len(names))
	for _, s := range names {
		e, err := shop.Services.Get(s)
		if err != nil {
			return nil, fmt.Errorf("audit streams: %w", err)
		}
		pool, err := shop.Pool(s)
		if err != nil {
			return nil, fmt.Errorf("audit streams: %w", err)
		}
		a, err := auditStream(ctx, pool, js, e, cfg)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

// auditStream audits one service's stream.
func auditStream(ctx context.Context, db *pgxpool.Pool, js jetstream.JetStream, e registry.Entry, cfg AuditConfig) (StreamAudit, error) {
	service := e.Name
	a := StreamAudit{Service: service, Stream: e.Stream}
	// The outbox first: see AuditConfig.Grace. Newest first, by the
	// partial index on published_at, so that a limit takes the newest.
	limit := any(nil)
	if cfg.Newest > 0 {
		limit = cfg.Newest
	}
	rows, err := db.Query(ctx, `
		SELECT event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, published_at, occurred_at
		FROM outbox
		WHERE published_at > now() - $1 * interval '1 microsecond'
		  AND published_at <= now() - $2 * interval '1 microsecond'
		ORDER BY published_at DESC LIMIT $3`,
		cfg.Window.Microseconds(), cfg.Grace.Microseconds(), limit)
	if err != nil {
		return a, fmt.Errorf("audit %s: read published events: %w", service, err)
	}
	var events []Lost
	var from time.Time
	var l Lost
	var occurred time.Time
	_, err = pgx.ForEachRow(rows, []any{&l.EventID, &l.Type, &l.AggregateType, &l.AggregateID, &l.Seq, &l.PublishedAt, &occurred}, func() error {
		l.Service, l.Stream = a.Service, a.Stream
		events = append(events, l)
		if from.IsZero() || occurred.Before(from) {
			from = occurred
		}
		return nil
	})
	if err != nil {
		return a, fmt.Errorf("audit %s: read published events: %w", service, err)
	}
	a.Published = len(events)
	if len(events) == 0 {
		return a, nil
	}
	if cfg.Newest > 0 && len(events) == cfg.Newest {
		oldest := events[len(events)-1].PublishedAt
		err := db.QueryRow(ctx, `SELECT count(*) FROM outbox
			WHERE published_at > now() - $1 * interval '1 microsecond' AND published_at < $2`,
			cfg.Window.Microseconds(), oldest).Scan(&a.Older)
		if err != nil {
			return a, fmt.Errorf("audit %s: count older published events: %w", service, err)
		}
	}
	missing := make(map[uuid.UUID]int, len(events)) // event id → index in events
	for i, e := range events {
		missing[e.EventID] = i
	}
	a.Scanned, a.Err = scan(ctx, js, a.Stream, from.Add(-clockSkew), missing)
	if ctx.Err() != nil {
		return a, fmt.Errorf("audit %s: %w", service, ctx.Err())
	}
	if a.Err != nil {
		return a, nil
	}
	for _, i := range missing {
		a.Lost = append(a.Lost, events[i])
	}
	slices.SortFunc(a.Lost, func(x, y Lost) int {
		return cmp.Or(cmp.Compare(x.AggregateType, y.AggregateType), cmp.Compare(x.AggregateID, y.AggregateID), cmp.Compare(x.Seq, y.Seq))
	})
	return a, nil
}

// scan reads stream's messages from from on and deletes each Nats-Msg-Id it
// meets from missing. It stops at the stream's last sequence as it was when
// the scan began, when no message is left, or when missing is empty, and
// returns how many messages it read.
//
// It creates nothing on the server: the audit user may not create a
// consumer, not even an ephemeral one (broker.AuditPermissions). It reads
// by JetStream's direct get (the stream's AllowDirect,
// broker.StreamConfig), in batches of scanBatch: one request to
// $JS.API.DIRECT.GET.<stream>, answered by one of the stream's replicas
// with the messages, each with its sequence, and an end-of-batch status
// (nats-server 2.11 and later; ADR-31). The first batch starts at from
// ({"start_time"}), each next one after the last sequence read. A replica
// answers direct gets once it has nearly caught up with the stream (90% in
// nats-server 2.15), so one that lags may end the stream early: when the
// batches end before the last sequence, the rest is read from the stream's
// leader, a message at a time ($JS.API.STREAM.MSG.GET), which usually only
// says that nothing is left (the newest messages were deleted). A server
// older than 2.11 answers one message per request and ignores the start
// time: the scan is then correct but reads the stream from its first
// message, one request each.
func scan(ctx context.Context, js jetstream.JetStream, stream string, from time.Time, missing map[uuid.UUID]int) (int, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", stream, err)
	}
	info := st.CachedInfo()
	if info.State.Msgs == 0 {
		return 0, nil
	}
	api := cmp.Or(js.Options().APIPrefix, jetstream.DefaultAPIPrefix)
	if !strings.HasSuffix(api, ".") {
		api += "."
	}
	sc := &scanner{nc: js.Conn(), api: api, stream: stream, last: info.State.LastSeq, missing: missing}
	more := true
	for more && !sc.done {
		req := broker.DirectGetRequest{Seq: sc.next, NextFor: ">", Batch: scanBatch, MaxBytes: scanBatchBytes}
		if sc.next == 0 {
			req.StartTime = &from
		}
		if more, err = sc.direct(ctx, req); err != nil {
			return sc.read, fmt.Errorf("stream %s: %w", stream, err)
		}
	}
	for !sc.done {
		req := broker.DirectGetRequest{Seq: sc.next, NextFor: ">"}
		if sc.next == 0 {
			req.StartTime = &from
		}
		if err := sc.fromLeader(ctx, req); err != nil {
			return sc.read, fmt.Errorf("stream %s: %w", stream, err)
		}
	}
	return sc.read, nil
}

// A direct get batch: at most scanBatch messages and about scanBatchBytes
// (the server stops after the message that passes it). A batch is held
// whole by the client while it is read, so the two bound the memory of a
// scan whatever the stream holds.
const (
	scanBatch      = 1000
	scanBatchBytes = 8 << 20
)

// scanner is one scan's progress.
type scanner struct {
	nc      *nats.Conn
	api     string // "$JS.API."
	stream  string
	last    uint64 // the stream's last sequence when the scan began
	missing map[uuid.UUID]int

	read int    // messages read
	next uint64 // the sequence to read from; 0: from the scan's start time
	done bool   // at last, or nothing missing any more, or nothing left
}

// see notes the message at seq with headers h.
func (sc *scanner) see(seq uint64, h nats.Header) {
	sc.read++
	if id, err := uuid.Parse(h.Get(jetstream.MsgIDHeader)); err == nil {
		delete(sc.missing, id)
	}
	sc.next = seq + 1
	sc.done = seq >= sc.last || len(sc.missing) == 0
}

// direct reads one batch of direct gets and reports whether the replica
// that answered holds more after it.
func (sc *scanner) direct(ctx context.Context, req broker.DirectGetRequest) (more bool, err error) {
	return broker.DirectGetBatch(ctx, sc.nc, sc.api, sc.stream, req, func(seq uint64, h nats.Header) bool {
		sc.see(seq, h)
		return !sc.done
	})
}

// fromLeader reads one message from the stream's leader, and notes that
// nothing is left when it has none.
func (sc *scanner) fromLeader(ctx context.Context, req broker.DirectGetRequest) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	reply, err := sc.nc.RequestWithContext(ctx, sc.api+"STREAM.MSG.GET."+sc.stream, body)
	if err != nil {
		return fmt.Errorf("message get: %w", err)
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Sequence uint64 `json:"seq"`
			Header   []byte `json:"hdrs"`
		} `json:"message"`
	}
	if err := json.Unmarshal(reply.Data, &resp); err != nil {
		return fmt.Errorf("message get: %w", err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		sc.done = true
		return nil
	case resp.Error != nil:
		return fmt.Errorf("message get: %w", resp.Error)
	case resp.Message == nil:
		return errors.New("message get: an answer without a message")
	}
	h := nats.Header{}
	if len(resp.Message.Header) > 0 {
		if h, err = nats.DecodeHeadersMsg(resp.Message.Header); err != nil {
			return fmt.Errorf("message get: headers: %w", err)
		}
	}
	sc.see(resp.Message.Sequence, h)
	return nil
}
