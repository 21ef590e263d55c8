package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
)


func TestCDCRelayPublishesWithContractHeaders(t *testing.T) {
	e := setup(t)
	r := e.relay(t, Config{Mode: ModeCDC, PollInterval: time.Hour})
	start(t, r)
	streaming(t, r)
	var w Writer
	ev := event("o-1", "OrderCreated")
	ev.ID = uuid.Must(uuid.NewV7())
	ev.SchemaVersion = 2
	add(t, e.db.Pool, &w, ev, event("o-1", "OrderPaid"), event("o-2", "OrderCreated"))

	eventually(t, 10*time.Second, "events published", func() (bool, error) {
		return count(t, e.db.Pool, "published_at IS NOT NULL") == 3, nil
	})
	msg, err := e.stream.GetLastMsgForSubject(context.Background(), "ev.o-1.OrderCreated")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"Nats-Msg-Id": ev.ID.String(), "Event-Type": "OrderCreated", "Aggregate-Id": "o-1",
		"Aggregate-Seq": "1", "Schema-Version": "2", "traceparent": ev.Headers["traceparent"],
	}
	for k, v := range want {
		if got := msg.Header.Get(k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
	if string(msg.Data) != `{"order_id":"o-1"}` {
		t.Errorf("payload = %s", msg.Data)
	}
	if n := streamMsgs(t, e.stream); n != 3 {
		t.Errorf("stream holds %d messages, want 3", n)
	}
	st, err := ReadSlot(context.Background(), e.db.Pool, "")
	if err != nil {
		t.Fatal(err)
	}
	if !st.Exists || !st.Active || st.WALStatus != "reserved" {
		t.Errorf("slot = %+v", st)
	}
}
