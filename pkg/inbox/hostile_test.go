package inbox

import (
	"context"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Values a peer may put where the contract expects something else: out of
// every range the tables hold, not UTF-8, NUL, huge, empty, or another
// aggregate's.
var (
	hostileSeqs = []string{"1", "2", "3", "7", "0", "-1", "2147483647", "2147483648", "4294967296",
		"9223372036854775806", "9223372036854775807", "9223372036854775808", "1e3", " 1", "", "\x00", "\xff"}
	hostileTexts = []string{"", "\x00", "a\x00b", "\xff\xfe", strings.Repeat("x", 10_000), "o.ther", "é", "🙂"}
	hostileInts  = []string{"1", "0", "2", "2147483648", "9223372036854775807", "x", ""}
	hostileTimes = []string{time.Now().UTC().Format(time.RFC3339Nano), "", "yesterday", "9999-12-31T23:59:59Z",
		"0001-01-01T00:00:00Z", "2026-02-30T00:00:00Z"}
	hostileData = [][]byte{[]byte(`{"order_id":"x"}`), nil, []byte("\x00\xff"), []byte(`{"a":"\u0000"}`),
		[]byte(strings.Repeat("[", 5000))}
)

// hostile is the message of draw: one valid event of aggregate agg with
// some of its headers, its subject or its payload replaced by a hostile
// value.
func hostile(r *rand.Rand, agg string) *nats.Msg {
	pick := func(vs []string) string { return vs[r.IntN(len(vs))] }
	ev := newEvent(agg, int64(1+r.IntN(3)))
	m := ev.msg()
	for range 1 + r.IntN(3) {
		switch r.IntN(9) {
		case 0:
			m.Header.Set("Aggregate-Seq", pick(hostileSeqs))
		case 1:
			m.Header.Set("Aggregate-Id", pick(hostileTexts))
		case 2:
			m.Header.Set("Aggregate-Type", pick(hostileTexts))
		case 3:
			m.Header.Set("Event-Type", pick(hostileTexts))
		case 4:
			m.Header.Set("Schema-Version", pick(hostileInts))
		case 5:
			m.Header.Set("Occurred-At", pick(hostileTimes))
		case 6:
			m.Data = hostileData[r.IntN(len(hostileData))]
		case 7:
			// A subject that names another aggregate than the headers do.
			m.Subject = "orders.other-" + agg + "." + ev.typ
		case 8:
			m.Header.Set(jetstream.MsgIDHeader, pick([]string{uuid.Nil.String(), "x", "", uuid.NewString()}))
		}
	}
	return m
}

// Whatever a peer puts in a message's headers, subject or payload, the
// message ends applied, parked (an early sequence of its aggregate) or
// dead-lettered, within the consumer's attempts; none is retried for ever,
// and the valid events around it are applied in order.
func TestHostileMessagesEndAppliedParkedOrDeadLettered(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := e.config(t, record(""))
	cfg.MaxDeliver = 3
	run(t, e.consumer(t, e.pool, e.js, cfg))

	r := rand.New(rand.NewPCG(24, 1))
	var msgs []*nats.Msg
	for i := range 300 {
		msgs = append(msgs, hostile(r, "h"+strconv.Itoa(i%40)))
	}
	requireEachEnds(t, e, msgs)
}

// FuzzHostileMessage is the same check, one message at a time, for `go
// test -fuzz`: each input is published to a real stream and consumed into
// a real database.
func FuzzHostileMessage(f *testing.F) {
	for _, s := range hostileSeqs {
		f.Add(s, "o1", "OrderCreated", "1", []byte(`{}`))
	}
	for _, s := range hostileTexts {
		f.Add("1", s, "OrderCreated", "1", []byte(`{}`))
		f.Add("1", "o1", s, "1", []byte(`{}`))
	}
	f.Add("1", "o1", "OrderCreated", "2147483648", []byte("\x00"))
	// One world for every input: a fresh schema and server each would
	// take longer than the input.
	e := setup(f)
	cfg := e.config(f, record(""))
	cfg.MaxDeliver = 3
	run(f, e.consumer(f, e.pool, e.js, cfg))
	f.Fuzz(func(t *testing.T, seq, agg, typ, version string, data []byte) {
		m := newEvent("o1", 1).msg()
		m.Header.Set("Aggregate-Seq", seq)
		m.Header.Set("Aggregate-Id", agg)
		m.Header.Set("Event-Type", typ)
		m.Header.Set("Schema-Version", version)
		m.Data = data
		requireEachEnds(t, e, []*nats.Msg{m})
	})
}

// requireEachEnds publishes msgs (those the server accepts) and requires
// each to end applied, parked or dead-lettered once the consumer has
// settled every message.
func requireEachEnds(t *testing.T, e *env, msgs []*nats.Msg) {
	t.Helper()
	ctx := context.Background()
	sent := map[uint64]*nats.Msg{}
	for _, m := range msgs {
		ack, err := e.js.PublishMsg(ctx, m)
		if err != nil {
			continue // a subject or header the broker itself refuses never reaches the inbox
		}
		sent[ack.Sequence] = m
	}
	eventually(t, "every message is settled", func() bool { return e.settled(t) })

	ended := map[uint64]string{}
	dead, err := ListDeadLetters(ctx, e.db.Pool, testConsumer, 10_000)
	if err != nil {
		t.Fatal(err)
	}
	for _, dl := range dead {
		ended[dl.StreamSeq] = "dead"
	}
	parked, err := ListParked(ctx, e.db.Pool, testConsumer, 10_000)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range parked {
		ended[p.StreamSeq] = "parked"
	}
	applied := map[string]bool{}
	rows, err := e.db.Pool.Query(ctx, `SELECT event_id::text FROM effects`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		applied[id] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for seq, m := range sent {
		id := m.Header.Get(jetstream.MsgIDHeader)
		switch {
		case ended[seq] != "":
		case applied[id]:
		default:
			t.Errorf("stream seq %d (subject %q, headers %q): neither applied, parked nor dead-lettered",
				seq, m.Subject, m.Header)
		}
	}
}
