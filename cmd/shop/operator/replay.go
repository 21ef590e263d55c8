package operator

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/outbox"
)

// parseSince reads --since: RFC 3339, or a duration back from now.
func parseSince(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("--since %q: want an RFC 3339 time (2026-01-02T15:04:05Z) or a positive duration (1h30m)", s)
}

// replayJSON is one service's count in the --json output of replay.
type replayJSON struct {
	Service     string `json:"service"`
	Republished int    `json:"republished"`
}

// replay is `shop outbox replay --service S (--since T | --aggregate ID)`:
// it marks the chosen published events to be published again, by the
// relay, with their ids, so that consumers absorb them as duplicates.
func (c *command) replay(ctx context.Context, args []string) error {
	fs := c.flags("")
	service := fs.String("service", "", "the `service` whose outbox to replay, or all (required)")
	since := fs.String("since", "", "replay events that occurred at or after `T` (RFC 3339, or a duration: 1h = the last hour)")
	aggregate := fs.String("aggregate", "", "replay the events of this aggregate `ID` (an order id, or a SKU)")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	if *service == "" {
		return c.usageErr("--service is required (a service name, or all)")
	}
	if *since == "" && *aggregate == "" {
		return c.usageErr("refusing to replay every event: give --since T or --aggregate ID (or both)")
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	var from *time.Time
	if *since != "" {
		t, err := parseSince(*since, time.Now())
		if err != nil {
			return c.usageErr("%v", err)
		}
		from = &t
	}
	var out []replayJSON
	total := 0
	for _, name := range names {
		p, err := c.pool(ctx, name)
		if err != nil {
			return err
		}
		n := 0
		// One transaction: the relay sees all the copies or none, and takes
		// them in event id order, which is the order they first went out.
		err = pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
			n = 0
			rows, err := tx.Query(ctx, `
				SELECT event_id FROM outbox
				WHERE published_at IS NOT NULL
				  AND ($1::timestamptz IS NULL OR occurred_at >= $1)
				  AND ($2::text IS NULL OR aggregate_id = $2)
				ORDER BY event_id
				FOR UPDATE`, from, nullIfEmpty(*aggregate))
			if err != nil {
				return err
			}
			ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
			if err != nil {
				return err
			}
			for _, id := range ids {
				if err := outbox.Republish(ctx, tx, id); err != nil {
					return err
				}
				n++
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("%s: replay: %w", name, err)
		}
		out = append(out, replayJSON{Service: name, Republished: n})
		total += n
	}
	if c.json {
		return c.printJSON(map[string]any{"republished": total, "services": out})
	}
	for _, r := range out {
		fmt.Fprintf(c.stdout, "%s: %d published event(s) marked to be published again\n", r.Service, r.Republished)
	}
	if len(out) > 1 {
		fmt.Fprintf(c.stdout, "total: %d\n", total)
	}
	return nil
}

// nullIfEmpty is s as a nullable query argument: nil when empty.
func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}
