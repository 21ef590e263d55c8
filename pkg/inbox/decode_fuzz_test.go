package inbox

import (
	"bytes"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
)

// FuzzEnvelope feeds decode, the reader of a JetStream message's headers,
// arbitrary subjects, header values and payloads. It must never panic, and
// it must either refuse the message with a poison error that names the
// subject, or return a Message whose fields agree with the headers and the
// contract (docs/events.md): a UUID event id, a type, an aggregate id, a
// sequence of at least 1, an RFC 3339 time and a subject with a source.
//
// The seed corpus is in testdata/fuzz/FuzzEnvelope; plain go test runs it.
// Run the fuzzer with
//
//	go test -run '^$' -fuzz FuzzEnvelope -fuzztime 60s ./pkg/inbox/
func FuzzEnvelope(f *testing.F) {
	id := "0192f0c4-5e2a-7b3c-8d4e-5f6a7b8c9d0e"
	now := "2026-11-29T12:00:00Z"
	// A few seeds in code as well; the committed corpus holds the rest.
	f.Add("orders.o-1.OrderCreated", id, "OrderCreated", "order", "o-1", "1", "1", now, []byte(`{"order_id":"o-1"}`))
	f.Add("", "", "", "", "", "", "", "", []byte(nil))
	f.Add("orders", id, "X", "", "a", "9223372036854775807", "1", now, []byte(`null`))

	f.Fuzz(func(t *testing.T, subject, eventID, typ, aggType, aggID, seq, version, occurred string, data []byte) {
		h := nats.Header{}
		for k, v := range map[string]string{
			hdrEventID: eventID, hdrEventType: typ, hdrAggregateType: aggType, hdrAggregateID: aggID,
			hdrAggregateSeq: seq, hdrSchemaVersion: version, hdrOccurredAt: occurred,
		} {
			if v != "" { // an empty string stands for a missing header
				h.Set(k, v)
			}
		}
		m, err := decode(subject, h, data)

		// Whatever the outcome, the message carries what was sent, for
		// the handler or the dead letter.
		if m.Subject != subject || !bytes.Equal(m.Data, data) || m.Type != typ || m.AggregateType != aggType || m.AggregateID != aggID {
			t.Fatalf("decode changed the raw fields: %+v", m)
		}
		if err != nil {
			if !errors.Is(err, ErrPoison) {
				t.Fatalf("refusal is not poison (it would be retried forever): %v", err)
			}
			if !strings.Contains(err.Error(), subject) || err.Error() == "" {
				t.Fatalf("refusal does not name the subject %q: %v", subject, err)
			}
			return
		}

		// Accepted: every field must be usable and agree with its header.
		if want, perr := uuid.Parse(eventID); perr != nil || m.EventID != want {
			t.Fatalf("accepted event id %q as %s (parse error %v)", eventID, m.EventID, perr)
		}
		if m.Type == "" || m.AggregateID == "" {
			t.Fatalf("accepted without type or aggregate id: %+v", m)
		}
		if n, serr := strconv.ParseInt(seq, 10, 64); serr != nil || n != m.Seq || m.Seq < 1 {
			t.Fatalf("accepted Aggregate-Seq %q as %d", seq, m.Seq)
		}
		if v, verr := strconv.Atoi(version); verr != nil || v != m.SchemaVersion {
			t.Fatalf("accepted Schema-Version %q as %d", version, m.SchemaVersion)
		}
		if at, terr := time.Parse(time.RFC3339, occurred); terr != nil || !at.Equal(m.OccurredAt) {
			t.Fatalf("accepted Occurred-At %q as %v", occurred, m.OccurredAt)
		}
		if source(subject) == "" || !strings.HasPrefix(subject, source(subject)) {
			t.Fatalf("accepted subject %q without a source", subject)
		}
	})
}
