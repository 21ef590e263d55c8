package operator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/pkg/inbox"
)

// deadLetterJSON is one dead letter in --json output.
type deadLetterJSON struct {
	Service       string              `json:"service"`
	ID            int64               `json:"id"`
	Consumer      string              `json:"consumer"`
	Stream        string              `json:"stream"`
	StreamSeq     uint64              `json:"stream_seq"`
	Subject       string              `json:"subject"`
	EventID       *uuid.UUID          `json:"event_id"`
	Headers       map[string][]string `json:"headers"`
	Payload       json.RawMessage     `json:"payload"`
	Error         string              `json:"error"`
	Attempts      int                 `json:"attempts"`
	FirstFailedAt time.Time           `json:"first_failed_at"`
	LastFailedAt  time.Time           `json:"last_failed_at"`
	RequeuedAt    *time.Time          `json:"requeued_at"`
}

// deadLettersList is `shop outbox dead-letters list [--service S]
// [--consumer C] [--limit N]`: the open dead letters, oldest first.
func (c *command) deadLettersList(ctx context.Context, args []string) error {
	out := []deadLetterJSON{}
	err := c.eachService(ctx, args, "dead letters", func(name string, p *pgxpool.Pool, consumer string, limit int) error {
		dls, err := inbox.ListDeadLetters(ctx, p, consumer, limit)
		if err != nil {
			return err
		}
		for _, dl := range dls {
			d := deadLetterJSON{
				Service: name, ID: dl.ID, Consumer: dl.Consumer, Stream: dl.Stream, StreamSeq: dl.StreamSeq,
				Subject: dl.Subject, Headers: dl.Header, Payload: rawJSON(dl.Data), Error: dl.Error,
				Attempts: dl.Attempts, FirstFailedAt: dl.FirstFailedAt, LastFailedAt: dl.LastFailedAt, RequeuedAt: dl.RequeuedAt,
			}
			if dl.EventID != uuid.Nil {
				d.EventID = &dl.EventID
			}
			if d.Headers == nil {
				d.Headers = map[string][]string{}
			}
			out = append(out, d)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return printList(c, out, "no open dead letters", "SERVICE\tID\tCONSUMER\tSUBJECT\tATTEMPTS\tLAST FAILED\tREQUEUED\tERROR",
		func(d deadLetterJSON) string {
			requeued := "-"
			if d.RequeuedAt != nil {
				requeued = d.RequeuedAt.Format(time.RFC3339)
			}
			return fmt.Sprintf("%s\t%d\t%s\t%s\t%d\t%s\t%s\t%s", d.Service, d.ID, d.Consumer, d.Subject, d.Attempts,
				d.LastFailedAt.Format(time.RFC3339), requeued, cli.OneLine(d.Error, 80))
		})
}

// deadLettersRequeue is `shop outbox dead-letters requeue <id> --service S`:
// the consumer applies the dead letter again, through its usual path, while
// it runs.
func (c *command) deadLettersRequeue(ctx context.Context, args []string) error {
	fs := c.flags(" <id>")
	service := fs.String("service", "", "the `service` whose dead letter it is (required: ids are per service)")
	pos, err := c.parse(fs, args, 1, "<id>")
	if err != nil {
		return err
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil || id <= 0 {
		return c.usageErr("%q is not a dead letter id (a positive integer, as dead-letters list shows)", pos[0])
	}
	if *service == "" || *service == "all" {
		return c.usageErr("--service is required: dead letter ids are numbered per service")
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	p, err := c.pool(ctx, names[0])
	if err != nil {
		return err
	}
	if err := inbox.RequeueDeadLetter(ctx, p, id); err != nil {
		if errors.Is(err, inbox.ErrNotFound) {
			return fmt.Errorf("%s has no open dead letter %d (resolved, or never there)", names[0], id)
		}
		return fmt.Errorf("%s: %w", names[0], err)
	}
	if c.json {
		return c.printJSON(map[string]any{"service": names[0], "id": id, "requeued": true})
	}
	fmt.Fprintf(c.stdout, "requeued dead letter %d of %s: its consumer retries it within a second while running\n", id, names[0])
	return nil
}

// deadLettersDiscard is `shop outbox dead-letters discard <id> --service S --reason TEXT`.
func (c *command) deadLettersDiscard(ctx context.Context, args []string) error {
	fs := c.flags(" <id>")
	service := fs.String("service", "", "the `service` whose dead letter it is (required: ids are per service)")
	reason := fs.String("reason", "", "why it is given up on (required; kept with the row)")
	pos, err := c.parse(fs, args, 1, "<id>")
	if err != nil {
		return err
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil || id <= 0 {
		return c.usageErr("%q is not a dead letter id (a positive integer, as dead-letters list shows)", pos[0])
	}
	if *service == "" || *service == "all" {
		return c.usageErr("--service is required: dead letter ids are numbered per service")
	}
	if *reason == "" {
		return c.usageErr("--reason is required: it is kept with the discarded dead letter")
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	p, err := c.pool(ctx, names[0])
	if err != nil {
		return err
	}
	if err := inbox.DiscardDeadLetter(ctx, p, id, *reason); err != nil {
		if errors.Is(err, inbox.ErrNotFound) {
			return fmt.Errorf("%s has no open dead letter %d (resolved, or never there)", names[0], id)
		}
		return fmt.Errorf("%s: %w", names[0], err)
	}
	if c.json {
		return c.printJSON(map[string]any{"service": names[0], "id": id, "discarded": true, "reason": *reason})
	}
	fmt.Fprintf(c.stdout, "discarded dead letter %d of %s: kept for audit, never applied\n", id, names[0])
	return nil
}
