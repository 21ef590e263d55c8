package inbox

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The headers the outbox relay puts on every event.
const (
	hdrEventID       = jetstream.MsgIDHeader // "Nats-Msg-Id": the event id, stable across retries
	hdrEventType     = "Event-Type"
	hdrAggregateType = "Aggregate-Type" // optional
	hdrAggregateID   = "Aggregate-Id"
	hdrAggregateSeq  = "Aggregate-Seq"
	hdrSchemaVersion = "Schema-Version"
	hdrOccurredAt    = "Occurred-At"
)

// Message is one decoded event as a handler sees it. A message that does not
// decode is a dead letter at once: each header of pkg/outbox's contract is
// required (Aggregate-Type may be empty), Aggregate-Seq runs from 1 to
// 2⁶³−2, texts are UTF-8 without NUL and at most 1 KiB, and the subject is
// <source>.<Aggregate-Id>.<Event-Type>.
type Message struct {
	EventID       uuid.UUID
	Type          string // Event-Type, e.g. "OrderCreated"
	AggregateType string // empty when the producer does not send it
	AggregateID   string
	Seq           int64 // 1, 2, 3 … per aggregate and producer
	SchemaVersion int
	OccurredAt    time.Time
	Subject       string // <source>.<aggregate id>.<type>
	Header        nats.Header
	Data          []byte // the JSON payload
}

// HandlerFunc applies a batch of events, in stream order, inside tx, the
// transaction that also records them as processed; it must not commit or
// roll it back. Any error rolls the batch back, and the same deliveries come
// again one at a time, so the bad one fails alone ([Poison] dead-letters it
// at once). Rows many aggregates share are best locked for the whole batch
// in one statement, in one global order, so batches never deadlock.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, batch []Batched) error

// EventFunc applies one event inside tx, under the rules of [HandlerFunc].
type EventFunc func(ctx context.Context, tx pgx.Tx, m Message) error

// Each is the HandlerFunc of a handler that takes one event at a time: it
// calls f on each event of the batch in turn, with the event's own Ctx.
func Each(f EventFunc) HandlerFunc {
	return func(_ context.Context, tx pgx.Tx, batch []Batched) error {
		for _, b := range batch {
			if err := f(b.Ctx, tx, b.Message); err != nil {
				return err
			}
		}
		return nil
	}
}

// Batched is one event of the batch handed to a [HandlerFunc].
type Batched struct {
	Message
	// Ctx is the event's own context, with its delivery's span: queue the
	// events it causes with Ctx, so they continue its trace.
	Ctx context.Context
}

// decode reads the event headers. A message that breaks the contract is
// poison: it would fail the same way on every delivery. The returned
// Message carries whatever could be read (the event id above all), for the
// dead letter.
func decode(subject string, h nats.Header, data []byte) (Message, error) {
	m := Message{
		Subject:       subject,
		Header:        h,
		Data:          data,
		Type:          h.Get(hdrEventType),
		AggregateType: h.Get(hdrAggregateType),
		AggregateID:   h.Get(hdrAggregateID),
	}
	var errs []error
	bad := func(name string, err error) {
		errs = append(errs, fmt.Errorf("header %s %q: %w", name, h.Get(name), err))
	}
	var err error
	// Every value the inbox stores must be one Postgres can hold: text
	// that is UTF-8 without NUL, a sequence whose successor fits a bigint.
	// A value that is not would fail the inbox's own statements on every
	// delivery; checked here, it is poison at once, with the reason.
	for _, name := range []string{hdrEventType, hdrAggregateType, hdrAggregateID} {
		if err := storableText(h.Get(name)); err != nil {
			bad(name, err)
		}
	}
	if err := storableText(subject); err != nil {
		errs = append(errs, fmt.Errorf("subject %q: %w", subject, err))
	}
	if m.EventID, err = uuid.Parse(h.Get(hdrEventID)); err != nil {
		bad(hdrEventID, err)
	} else if m.EventID == uuid.Nil {
		// Every producer's copy of "no id" would count as one event.
		bad(hdrEventID, errors.New("the nil UUID is no event id"))
	}
	if m.Type == "" {
		bad(hdrEventType, errors.New("missing"))
	}
	if m.AggregateID == "" {
		bad(hdrAggregateID, errors.New("missing"))
	}
	if m.Seq, err = strconv.ParseInt(h.Get(hdrAggregateSeq), 10, 64); err != nil {
		bad(hdrAggregateSeq, err)
	} else if m.Seq < 1 || m.Seq == math.MaxInt64 {
		bad(hdrAggregateSeq, fmt.Errorf("must be from 1 to %d", int64(math.MaxInt64-1)))
	}
	if v, err := strconv.ParseInt(h.Get(hdrSchemaVersion), 10, 32); err != nil {
		bad(hdrSchemaVersion, err)
	} else if m.SchemaVersion = int(v); m.SchemaVersion < 1 {
		bad(hdrSchemaVersion, errors.New("must be at least 1"))
	}
	if m.OccurredAt, err = time.Parse(time.RFC3339, h.Get(hdrOccurredAt)); err != nil {
		bad(hdrOccurredAt, err)
	}
	// The subject is the one the producer's outbox built from these
	// headers. One that names another aggregate or type than its headers
	// is forged or broken: applied, it would move the cursor of the
	// aggregate the headers name while the stream files it under another.
	if src := source(subject); src == "" {
		errs = append(errs, fmt.Errorf("subject %q has no source token", subject))
	} else if want := src + "." + m.AggregateID + "." + m.Type; subject != want && m.AggregateID != "" && m.Type != "" {
		errs = append(errs, fmt.Errorf("subject %q disagrees with its headers, which make it %q", subject, want))
	}
	if len(errs) > 0 {
		return m, Poison(fmt.Errorf("decode message on %s: %w", subject, errors.Join(errs...)))
	}
	return m, nil
}

// The headers the server sets on a message it copies from another stream:
// a republish names the stream it came from, a source the stream and
// sequence. A publisher cannot remove them (the server appends its own
// after the publisher's), and the outbox relay never sets them.
const (
	hdrRepublishedFrom = "Nats-Stream"
	hdrSourcedFrom     = "Nats-Stream-Source"
)

// stored says whether h is the header of a message that the stream took
// from a publisher, as pkg/outbox's relay publishes every event, and not a
// copy the server made from another stream: ErrForged, poison, if a copy.
// Every value counts, not the first only: the publisher of the original
// may have set one of its own ahead of the server's.
func stored(h nats.Header) error {
	var from []string
	for _, name := range []string{hdrRepublishedFrom, hdrSourcedFrom} {
		for _, v := range h.Values(name) {
			from = append(from, fmt.Sprintf("%s: %q", name, v))
		}
	}
	if len(from) == 0 {
		return nil
	}
	return Poison(fmt.Errorf("%w (%s)", ErrForged, strings.Join(from, ", ")))
}

// maxText bounds the text headers the inbox stores (and indexes: an
// aggregate id is part of a primary key, and a btree entry must fit a
// third of a page).
const maxText = 1024

// storableText says why s cannot be stored as a header value: not UTF-8,
// a NUL (Postgres text holds neither), or longer than maxText.
func storableText(s string) error {
	switch {
	case !utf8.ValidString(s):
		return errors.New("not UTF-8")
	case strings.ContainsRune(s, 0):
		return errors.New("contains NUL")
	case len(s) > maxText:
		return fmt.Errorf("longer than %d bytes", maxText)
	}
	return nil
}

// storable is s as the dead-letter store and the parking lot can keep it
// whatever a peer sent: invalid UTF-8 and NUL become U+FFFD. Only what
// decode already refused can differ; the payload is kept byte for byte.
func storable(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// storableHeader is h with every key and value storable (jsonb refuses
// \u0000 even escaped).
func storableHeader(h nats.Header) nats.Header {
	out := make(nats.Header, len(h))
	for k, vs := range h {
		k = storable(k)
		for _, v := range vs {
			out[k] = append(out[k], storable(v))
		}
	}
	return out
}

// source is the producer of an event: the first token of its subject.
func source(subject string) string {
	s, _, _ := strings.Cut(subject, ".")
	return s
}
