package operator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/ops/journey"
)

const traceHelp = `Prints one order's journey, read from the services' tables (no tracing
backend): every event of the order, when it was committed (outbox), published by
the relay, processed by each consumer (processed_events), with the time each hop
took; retries (outbox attempts, inbox_failures), dead and parked messages; the
saga's state changes (order_history) and the events it ignored. The dashboard
shows the same when an order is clicked.

Columns: the time (UTC), the time since the line before, the service whose
tables recorded the step, and what happened; a hop is measured from the step it
follows (a publish from its commit, a consumer from the publish, or from the
commit when it committed before the relay recorded the publish).

Not shown: duplicates the inboxes absorbed are counted per consumer (each
service's /metrics), not per event. Outboxes delete published events after
their retention, inboxes their processed_events rows after theirs: an older
order shows its state changes only, and says so.

`

// Trace is `shop trace <order-id> [--json]`: one order's journey, read
// from every service's tables. It has the outbox commands' flags (--json,
// --database-url) and their pools, one per service.
func (s Shop) Trace(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	c, err := s.newCommand("shop trace", getenv, stdout, stderr)
	if err != nil {
		return err
	}
	defer c.close()
	fs := c.flags(" <order-id>")
	usage := fs.Usage
	fs.Usage = func() { usage(); fmt.Fprint(stderr, "\n"+traceHelp) }
	pos, err := c.parse(fs, args, 1, " <order-id>")
	if err != nil {
		return err
	}
	id, err := uuid.Parse(pos[0])
	if err != nil {
		return c.usageErr("%q is not an order id (a UUID)", pos[0])
	}
	pools := make(map[string]journey.DB, len(c.schemas.Registry))
	for _, name := range c.schemas.Registry.Names() {
		p, err := c.pool(ctx, name)
		if err != nil {
			return err
		}
		pools[name] = p
	}
	j, err := journey.Load(ctx, pools, id)
	if errors.Is(err, journey.ErrNotFound) {
		return fmt.Errorf("%s: no order %s in any service's schema", c.name, id)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	if c.json {
		return c.printJSON(j)
	}
	return writeJourney(stdout, j)
}

// writeJourney prints j as aligned columns: time, +delta, service, what
// (with the hop's time).
func writeJourney(w io.Writer, j journey.Journey) error {
	status := j.Status
	if status == "" {
		status = "unknown to the order service"
	}
	day := ""
	if len(j.Entries) > 0 {
		day = ", " + j.Entries[0].At.UTC().Format("2006-01-02") + " UTC"
	}
	fmt.Fprintf(w, "order %s: %s (%d steps%s)\n", j.OrderID, status, len(j.Entries), day)
	tw := newTable(w)
	fmt.Fprintln(tw, "TIME\t+DELTA\tSERVICE\tWHAT")
	for i, e := range j.Entries {
		delta := ""
		if i > 0 {
			delta = "+" + cli.RoundDuration(e.SincePrevious).String()
		}
		what := e.What
		if e.HopFrom != "" {
			what += fmt.Sprintf(" (%s after %s)", cli.RoundDuration(e.Hop), e.HopFrom)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", e.At.UTC().Format("15:04:05.000000"), delta, e.Service, what)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, t := range j.Timeouts {
		when := "in " + cli.RoundDuration(time.Until(t.DueAt)).String()
		if d := time.Since(t.DueAt); d > 0 {
			when = "overdue by " + cli.RoundDuration(d).String() + ": the saga's scanner fires it next"
		}
		fmt.Fprintf(w, "armed: the saga's %s timeout, due %s (%s)\n", t.Name, t.DueAt.UTC().Format(time.RFC3339), when)
	}
	for _, n := range j.Notes {
		fmt.Fprintln(w, "note: "+strings.TrimSpace(n))
	}
	return nil
}
