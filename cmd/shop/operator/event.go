package operator

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/pkg/outbox"
)

// eventJSON is an outbox row in --json output.
type eventJSON struct {
	Service       string            `json:"service"`
	State         string            `json:"state"`
	EventID       uuid.UUID         `json:"event_id"`
	AggregateType string            `json:"aggregate_type"`
	AggregateID   string            `json:"aggregate_id"`
	AggregateSeq  int64             `json:"aggregate_seq"`
	EventType     string            `json:"event_type"`
	SchemaVersion int               `json:"schema_version"`
	Subject       string            `json:"subject"`
	Payload       json.RawMessage   `json:"payload"`
	Headers       map[string]string `json:"headers"`
	OccurredAt    time.Time         `json:"occurred_at"`
	Attempts      int               `json:"attempts"`
	LastError     *string           `json:"last_error"`
	ClaimedBy     *string           `json:"claimed_by"`
	PublishedAt   *time.Time        `json:"published_at"`
	DeadAt        *time.Time        `json:"dead_at"`
}

// stateOf names where r is in the relay's life cycle.
func stateOf(r outbox.Record) string {
	switch {
	case r.PublishedAt != nil:
		return "published"
	case r.DeadAt != nil:
		return "dead"
	}
	return "pending"
}

// eventOf is r, held by service name's outbox, as the JSON of show and dead.
func eventOf(name string, r outbox.Record) eventJSON {
	ev := eventJSON{
		Service: name, State: stateOf(r), EventID: r.EventID, AggregateType: r.AggregateType, AggregateID: r.AggregateID,
		AggregateSeq: r.Seq, EventType: r.Type, SchemaVersion: r.SchemaVersion, Subject: r.Subject,
		Payload: rawJSON(r.Payload), Headers: r.Headers, OccurredAt: r.OccurredAt, Attempts: r.Attempts,
		LastError: r.LastError, ClaimedBy: r.ClaimedBy, PublishedAt: r.PublishedAt, DeadAt: r.DeadAt,
	}
	if ev.Headers == nil {
		ev.Headers = map[string]string{}
	}
	return ev
}

// parseEventID reads an event id operand.
func (c *command) parseEventID(s string) (uuid.UUID, error) {
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, c.usageErr("%q is not an event id (a UUID)", s)
	}
	return id, nil
}

// locate parses `<event-id> [--service S]` and finds the event: the first
// steps of show and requeue.
func (c *command) locate(ctx context.Context, args []string) (string, outbox.Record, error) {
	fs := c.flags(" <event-id>")
	service := fs.String("service", "", "look only in this `service`'s outbox (default: all)")
	pos, err := c.parse(fs, args, 1, "<event-id>")
	if err != nil {
		return "", outbox.Record{}, err
	}
	id, err := c.parseEventID(pos[0])
	if err != nil {
		return "", outbox.Record{}, err
	}
	names, err := c.resolve(*service)
	if err != nil {
		return "", outbox.Record{}, err
	}
	return c.find(ctx, names, id)
}

// find returns the event and the service whose outbox holds it.
func (c *command) find(ctx context.Context, names []string, id uuid.UUID) (string, outbox.Record, error) {
	for _, name := range names {
		p, err := c.pool(ctx, name)
		if err != nil {
			return "", outbox.Record{}, err
		}
		r, err := outbox.Get(ctx, p, id)
		if errors.Is(err, outbox.ErrNotFound) {
			continue
		}
		if err != nil {
			return "", outbox.Record{}, fmt.Errorf("%s: %w", name, err)
		}
		return name, r, nil
	}
	return "", outbox.Record{}, fmt.Errorf("event %s is in no outbox of %s (it may have been published and deleted by retention)",
		id, strings.Join(names, ", "))
}

// dead lists the outboxes' dead events: what `status` counts, with the ids
// that `show` and `requeue` take.
func (c *command) dead(ctx context.Context, args []string) error {
	out := []eventJSON{}
	err := c.forServices(ctx, args, "dead events", false, func(name string, p *pgxpool.Pool, _ string, limit int) error {
		recs, err := outbox.ListDead(ctx, p, limit)
		for _, r := range recs {
			out = append(out, eventOf(name, r))
		}
		return err
	})
	if err != nil {
		return err
	}
	return printList(c, out, "no dead events", "SERVICE\tEVENT ID\tAGGREGATE\tSEQ\tTYPE\tATTEMPTS\tDEAD AT\tLAST ERROR",
		func(e eventJSON) string {
			lastErr := "-"
			if e.LastError != nil {
				lastErr = cli.OneLine(*e.LastError, 80)
			}
			return fmt.Sprintf("%s\t%s\t%s %s\t%d\t%s\t%d\t%s\t%s", e.Service, e.EventID, e.AggregateType, e.AggregateID,
				e.AggregateSeq, e.EventType, e.Attempts, e.DeadAt.Format(time.RFC3339), lastErr)
		})
}

// show is `shop outbox show <event-id> [--service S]`: every field of one
// event, headers and payload included.
func (c *command) show(ctx context.Context, args []string) error {
	name, r, err := c.locate(ctx, args)
	if err != nil {
		return err
	}
	ev := eventOf(name, r)
	if c.json {
		return c.printJSON(ev)
	}
	str := func(p *string) string {
		if p == nil {
			return "-"
		}
		return *p
	}
	tm := func(p *time.Time) string {
		if p == nil {
			return "-"
		}
		return p.Format(time.RFC3339Nano)
	}
	tw := newTable(c.stdout)
	for _, kv := range [][2]string{
		{"event id", r.EventID.String()},
		{"service", fmt.Sprintf("%s (schema %s)", name, schemaOf(c.schemas.Registry, name))},
		{"state", ev.State},
		{"aggregate", fmt.Sprintf("%s %s, seq %d", r.AggregateType, r.AggregateID, r.Seq)},
		{"event type", fmt.Sprintf("%s (schema version %d)", r.Type, r.SchemaVersion)},
		{"subject", r.Subject},
		{"occurred at", r.OccurredAt.Format(time.RFC3339Nano)},
		{"attempts", strconv.Itoa(r.Attempts)},
		{"last error", str(r.LastError)},
		{"claimed by", str(r.ClaimedBy)},
		{"published at", tm(r.PublishedAt)},
		{"dead at", tm(r.DeadAt)},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", kv[0], kv[1])
	}
	keys := make([]string, 0, len(r.Headers))
	for k := range r.Headers {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if len(keys) == 0 {
		fmt.Fprintf(tw, "headers:\t-\n")
	}
	for i, k := range keys {
		label := ""
		if i == 0 {
			label = "headers:"
		}
		fmt.Fprintf(tw, "%s\t%s: %s\n", label, k, r.Headers[k])
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(c.stdout, "payload:")
	var pretty bytes.Buffer
	if json.Indent(&pretty, r.Payload, "  ", "  ") == nil {
		fmt.Fprintf(c.stdout, "  %s\n", pretty.String())
	} else {
		fmt.Fprintf(c.stdout, "  %q\n", r.Payload)
	}
	return nil
}

// requeue is `shop outbox requeue <event-id> [--service S]`: a dead or
// waiting event back to pending, due now, its attempts reset. A published
// one is refused: replay publishes it again.
func (c *command) requeue(ctx context.Context, args []string) error {
	name, r, err := c.locate(ctx, args)
	if err != nil {
		return err
	}
	id := r.EventID
	if r.PublishedAt != nil {
		return fmt.Errorf("event %s (%s) was already published at %s: use `shop outbox replay --service %s --aggregate %s` to publish it again",
			id, name, r.PublishedAt.Format(time.RFC3339), name, r.AggregateID)
	}
	p, err := c.pool(ctx, name)
	if err != nil {
		return err
	}
	if err := outbox.Requeue(ctx, p, id); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	if c.json {
		return c.printJSON(map[string]any{"service": name, "event_id": id, "previous_state": stateOf(r), "state": "pending"})
	}
	fmt.Fprintf(c.stdout, "requeued %s %s (%s, was %s): pending, due now\n", name, id, r.Type, stateOf(r))
	return nil
}
