package operator

import (
	"context"
	"fmt"
	"text/tabwriter"
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
	// Slot is the replication slot of the service's outbox (a relay in
	// cdc mode made it); absent when there is none.
	Slot *slotStatus `json:"slot,omitempty"`
}

// slotStatus is a service's replication slot in shop outbox status: how
// much WAL it makes the server keep, and how close that is to the limit.
type slotStatus struct {
	Name             string  `json:"name"`
	Active           bool    `json:"active"`     // a relay streams it now
	WALStatus        string  `json:"wal_status"` // reserved, extended, unreserved, lost
	LagBytes         int64   `json:"lag_bytes"`
	LagAgeSeconds    float64 `json:"lag_age_seconds"`     // 0: no relay streamed since it was made
	SafeWALSizeBytes int64   `json:"safe_wal_size_bytes"` // -1: no limit
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
		// The slot is read whatever mode the services run in (this
		// command cannot know it): a slot left by a service switched back
		// to poll pins WAL all the same.
		ss, err := outbox.ReadSlot(ctx, p, "")
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if ss.Exists {
			s.Slot = &slotStatus{Name: ss.Slot, Active: ss.Active, WALStatus: ss.WALStatus, LagBytes: ss.LagBytes,
				LagAgeSeconds: ss.LagAge.Seconds(), SafeWALSizeBytes: ss.SafeWALSize}
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
	if err := tw.Flush(); err != nil {
		return err
	}
	return printSlots(c, out)
}

// printSlots prints the replication slots of the services that have one,
// under the table of shop outbox status; nothing when none has.
func printSlots(c *command, out []serviceStatus) error {
	var tw *tabwriter.Writer
	for _, s := range out {
		if s.Slot == nil {
			continue
		}
		if tw == nil {
			fmt.Fprintln(c.stdout)
			tw = newTable(c.stdout)
			fmt.Fprintln(tw, "SERVICE\tSLOT\tACTIVE\tWAL STATUS\tLAG\tLAG AGE\tSAFE WAL LEFT")
		}
		lagAge, safe := "-", "unlimited"
		if s.Slot.LagAgeSeconds > 0 {
			lagAge = cli.RoundDuration(time.Duration(s.Slot.LagAgeSeconds * float64(time.Second))).String()
		}
		if s.Slot.SafeWALSizeBytes >= 0 {
			safe = bytesText(s.Slot.SafeWALSizeBytes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%t\t%s\t%s\t%s\t%s\n", s.Service, s.Slot.Name, s.Slot.Active, s.Slot.WALStatus,
			bytesText(s.Slot.LagBytes), lagAge, safe)
	}
	if tw == nil {
		return nil
	}
	return tw.Flush()
}

// bytesText is n bytes for a person: 512 B, 3.2 MiB.
func bytesText(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
