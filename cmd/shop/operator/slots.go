package operator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/pkg/outbox"
)

const slotsUsage = `Usage: shop slots <command> [flags]

The replication slots and publications of the services' outboxes, which a
relay in cdc mode makes (named outbox_<database>_<schema>). A slot keeps WAL
on its server until a relay confirms it, streamed or not, and Postgres will not
start with wal_level below logical while a logical slot exists: drop the
shop's slots before switching a service to poll for good or lowering wal_level
(docs/operating.md, "Replication slots").

Commands:
  list [--service S]           each service's slot and publication: whether a relay
                               streams it (and which), its WAL status, the WAL it holds;
                               then the servers' other replication slots, which a
                               wal_level change must also account for
  drop [--service S] [-force]  drop each service's slot and its publication (default:
                               every service). A slot a relay streams is refused unless
                               -force, which ends that stream. A relay still in cdc mode
                               makes its slot again: set <SERVICE>_RELAY_MODE=poll and
                               restart the service (or stop it) first

Every command takes --json (machine-readable output) and --database-url URL
(DATABASE_URL; a service's own <SERVICE>_DATABASE_URL is honoured).
`

// Slots is `shop slots <command> [flags]`; args starts with the command.
func (s Shop) Slots(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, slotsUsage)
		return fmt.Errorf("slots: missing command: %w", cli.ErrUsage)
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, slotsUsage)
		return nil
	}
	c, err := s.newCommand("shop slots "+sub, getenv, stdout, stderr)
	if err != nil {
		return err
	}
	c.help = "shop slots -h"
	defer c.close()
	switch sub {
	case "list":
		return c.slotsList(ctx, args)
	case "drop":
		return c.slotsDrop(ctx, args)
	}
	fmt.Fprintf(stderr, "shop slots: unknown command %q\n\n%s", sub, slotsUsage)
	return fmt.Errorf("slots: unknown command %q: %w", sub, cli.ErrUsage)
}

// serviceSlot is one service's row of shop slots list.
type serviceSlot struct {
	Service     string `json:"service"`
	Slot        string `json:"slot"`
	Exists      bool   `json:"exists"`
	Publication bool   `json:"publication"`
	Active      bool   `json:"active"`             // a relay streams it now
	Streamer    string `json:"streamer,omitempty"` // that relay's name
	ActivePID   int    `json:"active_pid,omitempty"`
	WALStatus   string `json:"wal_status,omitempty"`
	// LagBytes: confirmed position behind the server's; RestartLagBytes:
	// the WAL the server keeps for the slot.
	LagBytes        int64   `json:"lag_bytes"`
	RestartLagBytes int64   `json:"restart_lag_bytes"`
	LagAgeSeconds   float64 `json:"lag_age_seconds"` // 0: no relay streamed since it was made
}

// otherSlot is a replication slot on a service's server that is no
// service's: another shop's, another program's, a retired service's.
type otherSlot struct {
	Slot     string `json:"slot"`
	Type     string `json:"type"`     // logical or physical
	Database string `json:"database"` // a logical slot's
	Active   bool   `json:"active"`
}

type slotsReport struct {
	Services []serviceSlot `json:"services"`
	Other    []otherSlot   `json:"other"`
}

// slotsList is `shop slots list [--service S]`.
func (c *command) slotsList(ctx context.Context, args []string) error {
	fs := c.flags("")
	service := fs.String("service", "", "only this `service` (default: all)")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	report := slotsReport{Services: []serviceSlot{}, Other: []otherSlot{}}
	ours := map[string]bool{}
	for _, name := range names {
		_, ss, err := c.readSlot(ctx, name)
		if err != nil {
			return err
		}
		ours[ss.Slot] = true
		report.Services = append(report.Services, serviceSlot{Service: name, Slot: ss.Slot, Exists: ss.Exists,
			Publication: ss.Publication, Active: ss.Active, Streamer: ss.Streamer, ActivePID: ss.ActivePID,
			WALStatus: ss.WALStatus, LagBytes: ss.LagBytes, RestartLagBytes: ss.RestartLagBytes, LagAgeSeconds: ss.LagAge.Seconds()})
	}
	// Every slot of the services' servers, once: services may share a
	// server or not.
	seen := map[string]bool{}
	for _, name := range names {
		rows, err := c.pools[name].Query(ctx, `SELECT slot_name, slot_type, coalesce(database, ''), active
			FROM pg_replication_slots ORDER BY slot_name`)
		if err != nil {
			return fmt.Errorf("%s: list replication slots: %w", name, err)
		}
		slots, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (otherSlot, error) {
			var o otherSlot
			err := r.Scan(&o.Slot, &o.Type, &o.Database, &o.Active)
			return o, err
		})
		if err != nil {
			return fmt.Errorf("%s: list replication slots: %w", name, err)
		}
		for _, o := range slots {
			if key := o.Database + "/" + o.Slot; !ours[o.Slot] && !seen[key] {
				seen[key] = true
				report.Other = append(report.Other, o)
			}
		}
	}
	if c.json {
		return c.printJSON(report)
	}
	tw := newTable(c.stdout)
	fmt.Fprintln(tw, "SERVICE\tSLOT\tPUBLICATION\tSTREAMED BY\tWAL STATUS\tLAG\tWAL HELD\tLAG AGE")
	for _, s := range report.Services {
		if !s.Exists {
			pub := "-"
			if s.Publication {
				pub = "yes"
			}
			fmt.Fprintf(tw, "%s\t%s (none)\t%s\t-\t-\t-\t-\t-\n", s.Service, s.Slot, pub)
			continue
		}
		by, lagAge := "nobody", "-"
		if s.Active {
			by = fmt.Sprintf("%s (pid %d)", cmpOr(s.Streamer, "?"), s.ActivePID)
		}
		if s.LagAgeSeconds > 0 {
			lagAge = cli.RoundDuration(time.Duration(s.LagAgeSeconds * float64(time.Second))).String()
		}
		pub := "no"
		if s.Publication {
			pub = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Service, s.Slot, pub, by, s.WALStatus,
			bytesText(s.LagBytes), bytesText(s.RestartLagBytes), lagAge)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(report.Other) == 0 {
		return nil
	}
	fmt.Fprintln(c.stdout, "\nOther replication slots on the services' servers (not the shop's to drop; a logical one also keeps Postgres from starting with wal_level below logical):")
	tw = newTable(c.stdout)
	fmt.Fprintln(tw, "SLOT\tTYPE\tDATABASE\tACTIVE")
	for _, o := range report.Other {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%t\n", o.Slot, o.Type, cmpOr(o.Database, "-"), o.Active)
	}
	return tw.Flush()
}

// readSlot reads the state of the slot a service's relay streams in cdc
// mode, with the pool of that service's database.
func (c *command) readSlot(ctx context.Context, service string) (*pgxpool.Pool, outbox.SlotStats, error) {
	p, err := c.pool(ctx, service)
	if err != nil {
		return nil, outbox.SlotStats{}, err
	}
	ss, err := outbox.ReadSlot(ctx, p, "")
	if err != nil {
		return nil, outbox.SlotStats{}, fmt.Errorf("%s: %w", service, err)
	}
	return p, ss, nil
}

func cmpOr(s, fallback string) string {
	if s == "" {
		return fallback
	}
	return s
}

// droppedSlot is one service's line of shop slots drop.
type droppedSlot struct {
	Service string `json:"service"`
	Slot    string `json:"slot"`
	// Dropped: the slot or its publication existed and is gone.
	Dropped bool `json:"dropped"`
	// Refused says why a slot was left: a relay streams it.
	Refused string `json:"refused,omitempty"`
}

// errSlotsRefused: shop slots drop left a slot a relay streams.
var errSlotsRefused = errors.New("slots streamed by a relay were not dropped (stop their relays, or -force)")

// slotsDrop is `shop slots drop [--service S] [-force]`.
func (c *command) slotsDrop(ctx context.Context, args []string) error {
	fs := c.flags("")
	service := fs.String("service", "", "only this `service` (default: all)")
	force := fs.Bool("force", false, "drop a slot a relay streams too, ending its stream (a relay still in cdc mode makes it again)")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	out := make([]droppedSlot, 0, len(names))
	refused := 0
	for _, name := range names {
		p, ss, err := c.readSlot(ctx, name)
		if err != nil {
			return err
		}
		d := droppedSlot{Service: name, Slot: ss.Slot}
		if ss.Exists || ss.Publication {
			drop := outbox.DropIdleSlot
			if *force {
				drop = outbox.DropSlot
			}
			err := drop(ctx, p, ss.Slot)
			switch {
			case errors.Is(err, outbox.ErrSlotActive):
				refused++
				// Read again for the relay's name: it may have just
				// started streaming.
				by := "a relay"
				if again, rerr := outbox.ReadSlot(ctx, p, ss.Slot); rerr == nil && again.Streamer != "" {
					by = fmt.Sprintf("relay %s (pid %d)", again.Streamer, again.ActivePID)
				}
				d.Refused = fmt.Sprintf("%s streams it: set %s_RELAY_MODE=poll and restart the service (or stop it), "+
					"then run this again; or -force, which ends the stream (a relay still in cdc mode makes the slot again)",
					by, strings.ToUpper(name))
			case err != nil:
				return fmt.Errorf("%s: %w", name, err)
			default:
				d.Dropped = true
			}
		}
		out = append(out, d)
	}
	if c.json {
		if err := c.printJSON(out); err != nil {
			return err
		}
	} else {
		for _, d := range out {
			switch {
			case d.Refused != "":
				fmt.Fprintf(c.stdout, "%s: slot %s NOT dropped: %s\n", d.Service, d.Slot, d.Refused)
			case d.Dropped:
				fmt.Fprintf(c.stdout, "%s: dropped slot %s and its publication\n", d.Service, d.Slot)
			default:
				fmt.Fprintf(c.stdout, "%s: no slot %s\n", d.Service, d.Slot)
			}
		}
	}
	if refused > 0 {
		return fmt.Errorf("%s: %d %w", c.name, refused, errSlotsRefused)
	}
	return nil
}
