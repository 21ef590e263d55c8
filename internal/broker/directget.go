package broker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DirectGetRequest is the body of a JetStream message get, direct or from
// the leader (nats-server's JSApiMsgGetRequest): the message at or after
// Seq, or after StartTime, whose subject matches NextFor; Batch and
// MaxBytes, for direct gets only, ask for several.
type DirectGetRequest struct {
	Seq       uint64     `json:"seq,omitempty"`
	StartTime *time.Time `json:"start_time,omitempty"`
	NextFor   string     `json:"next_by_subj,omitempty"`
	Batch     int        `json:"batch,omitempty"`
	MaxBytes  int        `json:"max_bytes,omitempty"`
}

// NumPendingHeader is on every message of a direct get batch (and on its
// end): how many messages follow.
const NumPendingHeader = "Nats-Num-Pending"

// DirectGetBatch reads one batch of direct gets from stream: one request
// to <api>DIRECT.GET.<stream> (api is "$JS.API." or the account's prefix),
// answered by one of the stream's replicas with the messages, each with
// its sequence, and an end-of-batch status (nats-server 2.11 and later;
// ADR-31). It calls see with each message's sequence and headers (its
// subject is jetstream.SubjectHeader) in stream order, until see returns
// false, and reports whether the replica holds more after the batch. It
// creates nothing on the server, so a user that may not create consumers
// (the audit user) can read a stream with it, a batch per round trip
// rather than a message.
//
// A server older than 2.11 answers one message per request and no end of
// batch: DirectGetBatch then returns after that one message with more
// true. Nothing at or after the sequence asked for is more false and no
// error.
func DirectGetBatch(ctx context.Context, nc *nats.Conn, api, stream string, req DirectGetRequest, see func(seq uint64, h nats.Header) bool) (more bool, err error) {
	body, err := json.Marshal(req)
	if err != nil {
		return false, err
	}
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return false, fmt.Errorf("direct get: %w", err)
	}
	defer sub.Unsubscribe()
	// The batch arrives as fast as the server sends it; a client-side limit
	// would drop messages of it, which would look lost. Batch and MaxBytes
	// bound it instead.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return false, fmt.Errorf("direct get: %w", err)
	}
	if err := nc.PublishRequest(api+"DIRECT.GET."+stream, inbox, body); err != nil {
		return false, fmt.Errorf("direct get: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	got := 0
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if errors.Is(err, nats.ErrNoResponders) {
			return false, fmt.Errorf("direct get: %w: the stream does not allow direct gets "+
				"(AllowDirect, which the shop's stream keeper restores: STREAMS_NATS_PASSWORD)", err)
		}
		if err != nil {
			return false, fmt.Errorf("direct get: %w", err)
		}
		switch status := m.Header.Get("Status"); status {
		case "":
			seq, err := strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
			if err != nil {
				return false, fmt.Errorf("direct get: a message without its sequence (%s): %w", jetstream.SequenceHeader, err)
			}
			got++
			if !see(seq, m.Header) {
				return false, nil // the rest of the batch goes with the subscription
			}
			if m.Header.Get(NumPendingHeader) == "" {
				return true, nil // a server before 2.11: one message per request, no end of batch
			}
		case "204": // end of batch: how many the replica holds after it
			pending, err := strconv.ParseUint(m.Header.Get(NumPendingHeader), 10, 64)
			return got > 0 && (err != nil || pending > 0), nil
		case "404": // nothing at or after the sequence asked for
			return false, nil
		default:
			return false, fmt.Errorf("direct get: %s %s", status, m.Header.Get("Description"))
		}
	}
}
