package operator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/pkg/inbox"
)

// The operator's commands on the events the inboxes parked: an event waits
// there for an earlier event of its aggregate. A discard keeps the row, with
// the time and the reason, for audit; nothing is applied.

// parkedJSON is one parked event in --json output.
type parkedJSON struct {
	Service   string              `json:"service"`
	Consumer  string              `json:"consumer"`
	EventID   uuid.UUID           `json:"event_id"`
	Subject   string              `json:"subject"`
	Aggregate string              `json:"aggregate_id"`
	Seq       int64               `json:"seq"`
	WaitsFor  int64               `json:"waits_for_seq"`
	ParkedAt  time.Time           `json:"parked_at"`
	Stream    string              `json:"stream"`
	StreamSeq uint64              `json:"stream_seq"`
	Headers   map[string][]string `json:"headers"`
	Payload   any                 `json:"payload"`
}

// parkedList is `shop outbox parked list`.
func (c *command) parkedList(ctx context.Context, args []string) error {
	out := []parkedJSON{}
	err := c.eachService(ctx, args, "parked events", func(name string, p *pgxpool.Pool, consumer string, limit int) error {
		list, err := inbox.ListParked(ctx, p, consumer, limit)
		if err != nil {
			return err
		}
		for _, e := range list {
			h := map[string][]string(e.Header)
			if h == nil {
				h = map[string][]string{}
			}
			out = append(out, parkedJSON{Service: name, Consumer: e.Consumer, EventID: e.EventID, Subject: e.Subject,
				Aggregate: e.AggregateID, Seq: e.Seq, WaitsFor: e.WaitsFor, ParkedAt: e.ParkedAt, Stream: e.Stream,
				StreamSeq: e.StreamSeq, Headers: h, Payload: rawJSON(e.Data)})
		}
		return nil
	})
	if err != nil {
		return err
	}
	return printList(c, out, "no parked events", "SERVICE\tCONSUMER\tEVENT\tSUBJECT\tSEQ\tWAITS FOR\tPARKED FOR",
		func(e parkedJSON) string {
			return fmt.Sprintf("%s\t%s\t%s\t%s\t%d\t%d\t%s", e.Service, e.Consumer, e.EventID, e.Subject, e.Seq, e.WaitsFor,
				cli.RoundDuration(time.Since(e.ParkedAt)))
		})
}

// parkedDiscard is `shop outbox parked discard <event-id> --service S --consumer C --reason TEXT`.
func (c *command) parkedDiscard(ctx context.Context, args []string) error {
	fs := c.flags(" <event-id>")
	service := fs.String("service", "", "the `service` whose consumer parked it (required)")
	consumer := fs.String("consumer", "", "the `consumer` that parked it (required)")
	reason := fs.String("reason", "", "why it is dropped (required; kept with the row)")
	pos, err := c.parse(fs, args, 1, "<event-id>")
	if err != nil {
		return err
	}
	id, err := c.parseEventID(pos[0])
	if err != nil {
		return err
	}
	switch {
	case *service == "" || *service == "all":
		return c.usageErr("--service is required")
	case *consumer == "":
		return c.usageErr("--consumer is required (parked list shows it)")
	case *reason == "":
		return c.usageErr("--reason is required: it is kept with the discarded event")
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	p, err := c.pool(ctx, names[0])
	if err != nil {
		return err
	}
	if err := inbox.DiscardParked(ctx, p, *consumer, id, *reason); err != nil {
		if errors.Is(err, inbox.ErrNotFound) {
			return fmt.Errorf("%s: %s has no open parked event %s", names[0], *consumer, id)
		}
		return fmt.Errorf("%s: %w", names[0], err)
	}
	if c.json {
		return c.printJSON(map[string]any{"service": names[0], "consumer": *consumer, "event_id": id, "discarded": true, "reason": *reason})
	}
	fmt.Fprintf(c.stdout, "discarded parked event %s of %s: kept for audit; its aggregate still waits for the missing event\n", id, *consumer)
	return nil
}
