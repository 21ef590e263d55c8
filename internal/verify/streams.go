package verify

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
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
	Scanned         int    // stream messages read (headers only)
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
// pass over the stream in sequence order
// with an ordered consumer that delivers headers only, from the window's
// earliest occurred_at (less a minute for the clocks of database and broker)
// up to the stream's last sequence, stopping early once every event was
// found. Its cost grows with the messages stored since the window began
// (republished copies included), not with the number of subjects: on the
// development machine 0.06–0.1 s per 10,000 events and 0.65–1.0 s per
// 100,000, outbox read included (docs/performance.md, "Auditing the
// streams"; `make bench` row 9 measures it). A database error stops
// it; a stream that cannot be read is reported in that service's
// StreamAudit.Err.
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

// scan reads stream's messages from from on, headers only, and deletes
// each Nats-Msg-Id it meets from missing. It stops at the stream's last
// sequence as it was when the scan began, when no message is left, or when
// missing is empty, and returns how many messages it read.
func scan(ctx context.Context, js jetstream.JetStream, stream string, from time.Time, missing map[uuid.UUID]int) (int, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", stream, err)
	}
	last := st.CachedInfo().State.LastSeq
	if st.CachedInfo().State.Msgs == 0 {
		return 0, nil
	}
	// An ephemeral consumer: it shows in the stream's consumer list, with
	// the rest of the window as its pending count, for as long as it lives
	// (anything that sums the consumers' backlog would count it; the order
	// service's admission control counts only the saga's own). So it is
	// deleted at the end, and the server removes it by itself after a few
	// idle seconds if this process dies first.
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		DeliverPolicy:     jetstream.DeliverByStartTimePolicy,
		OptStartTime:      &from,
		HeadersOnly:       true,
		InactiveThreshold: 10 * time.Second,
	})
	if err != nil {
		return 0, fmt.Errorf("stream %s: ordered consumer: %w", stream, err)
	}
	msgs, err := cons.Messages(jetstream.PullMaxMessages(1000))
	if err != nil {
		return 0, fmt.Errorf("stream %s: read: %w", stream, err)
	}
	defer func() {
		msgs.Stop()
		if info := cons.CachedInfo(); info != nil {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = js.DeleteConsumer(ctx, stream, info.Name) // else InactiveThreshold
		}
	}()
	// A consumer that starts after the last message has nothing to deliver,
	// and Next would wait for the next publish: ask first.
	info, err := cons.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s: consumer info: %w", stream, err)
	}
	if info.NumPending == 0 && info.Delivered.Consumer == 0 {
		return 0, nil
	}
	n := 0
	for len(missing) > 0 {
		m, err := msgs.Next(jetstream.NextContext(ctx))
		if err != nil {
			return n, fmt.Errorf("stream %s: read: %w", stream, err)
		}
		n++
		if id, err := uuid.Parse(m.Headers().Get(jetstream.MsgIDHeader)); err == nil {
			delete(missing, id)
		}
		md, err := m.Metadata()
		if err != nil {
			return n, fmt.Errorf("stream %s: message metadata: %w", stream, err)
		}
		if md.Sequence.Stream >= last || md.NumPending == 0 {
			break
		}
	}
	return n, nil
}
