package operator

import (
	"context"
	"fmt"
	"time"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// serviceStatus is one service's row of shop outbox status.
type serviceStatus struct {
	Service              string  `json:"service"`
	Schema               string  `json:"schema"`
	Pending              int64   `json:"pending"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	Dead                 int64   `json:"dead"`
	DeadLetters          int64   `json:"dead_letters"`
	Conflicts            int64   `json:"conflicts"`     // among the open dead letters
	Retrying             int64   `json:"retrying"`      // events a consumer failed on and will try again
	MostAttempts         int64   `json:"most_attempts"` // the failed attempts of the most retried of them
	Parked               int64   `json:"parked"`
	OldestParkedSeconds  float64 `json:"oldest_parked_seconds"`
}

// status is `shop outbox status [--service S]`: each service's backlog
// and what its relay and its consumers gave up on or hold back.
func (c *command) status(ctx context.Context, args []string) error {
	fs := c.flags("")
	service := fs.String("service", "", "only this `service` (default: all)")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	out := make([]serviceStatus, 0, len(names))
	for _, name := range names {
		p, err := c.pool(ctx, name)
		if err != nil {
			return err
		}
		st, err := outbox.ReadStats(ctx, p)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		s := serviceStatus{Service: name, Schema: schemaOf(c.schemas.Registry, name), Pending: st.Pending, Dead: st.Dead,
			OldestPendingSeconds: st.OldestPending.Seconds()}
		if err := p.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE conflict_with IS NOT NULL)
			FROM dead_letters WHERE resolved_at IS NULL`).Scan(&s.DeadLetters, &s.Conflicts); err != nil {
			return fmt.Errorf("%s: count dead letters: %w", name, err)
		}
		if err := p.QueryRow(ctx, `SELECT count(*), coalesce(max(attempts), 0) FROM inbox_failures`).
			Scan(&s.Retrying, &s.MostAttempts); err != nil {
			return fmt.Errorf("%s: count retried events: %w", name, err)
		}
		n, oldest, err := inbox.ParkedStats(ctx, p, "")
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		s.Parked = n
		if n > 0 {
			s.OldestParkedSeconds = time.Since(oldest).Seconds()
		}
		out = append(out, s)
	}
	if c.json {
		return c.printJSON(out)
	}
	tw := newTable(c.stdout)
	fmt.Fprintln(tw, "SERVICE\tPENDING\tOLDEST PENDING\tDEAD\tDEAD LETTERS\tCONFLICTS\tRETRYING\tMOST ATTEMPTS\tPARKED\tOLDEST PARKED")
	age := func(n int64, seconds float64) string {
		if n == 0 {
			return "-"
		}
		return cli.RoundDuration(time.Duration(seconds * float64(time.Second))).String()
	}
	for _, s := range out {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", s.Service, s.Pending, age(s.Pending, s.OldestPendingSeconds),
			s.Dead, s.DeadLetters, s.Conflicts, s.Retrying, s.MostAttempts, s.Parked, age(s.Parked, s.OldestParkedSeconds))
	}
	return tw.Flush()
}
