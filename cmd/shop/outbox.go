package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/app"
	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/verify"
	"github.com/shop-ref/shop/migrations"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

const outboxUsage = `Usage: shop outbox <command> [flags] [arguments]

Operator commands on the outboxes and dead letters of every service.

Commands:
  status                          backlog, oldest pending age, dead events, open dead
                                  letters (conflicts among them) and parked events with
                                  the oldest one's age, per service
  dead [--service S] [--limit N]  the dead events of each outbox (the relay gave up on
                                  them; their aggregate's later events wait), oldest first
  show <event-id>                 every field of one event, from whichever outbox holds it
  requeue <event-id>              a dead (or waiting) event back to pending, due now
  replay --service S (--since T | --aggregate ID)
                                  publish already published events again (consumers are
                                  idempotent: the copies are absorbed as duplicates);
                                  T is RFC 3339 or a duration such as 1h (= now - 1h);
                                  S is a service (order, inventory, …) or "all"
  republish --lost [--service S] [--nats-url URL]
                                  publish again every event its outbox marked published
                                  that its service's stream no longer holds (acked by the
                                  broker, then lost: an OS crash before the fsync, a disk,
                                  a deleted message), same id and sequence, each
                                  aggregate's in order; a consumer that had applied it
                                  absorbs the copy, the others apply it. Reads each
                                  stream once, headers only, back to the oldest event the
                                  outbox keeps (its retention). Within the stream's
                                  duplicate window (10 minutes after the first publish)
                                  the copy of a message deleted by hand is dropped: run
                                  it again after that (a crashed broker forgets the ids
                                  it lost, so their copies go through at once)
  dead-letters list [--service S] [--consumer C] [--limit N]
                                  unresolved dead letters, oldest first (a CONFLICT: an
                                  event at a sequence its aggregate applied under another id)
  dead-letters requeue <id> --service S
                                  ask the consumer to process a dead letter again
  dead-letters discard <id> --service S --reason TEXT
                                  give up on a dead letter for good (garbage, forged, the
                                  losing side of a conflict): kept for audit, resolved,
                                  never applied
  parked list [--service S] [--consumer C] [--limit N]
                                  events parked until an earlier event of their aggregate
                                  comes, oldest first, with the sequence each waits for
  parked discard <event-id> --service S --consumer C --reason TEXT
                                  drop a parked event (kept for audit); its aggregate still
                                  waits for the missing one, and a real event arriving at
                                  that sequence later takes its place

Every command takes --json (machine-readable output) and --database-url URL
(DATABASE_URL; a service's own <SERVICE>_DATABASE_URL is honoured); republish also
--nats-url URL (NATS_URL, default ` + app.DefaultNATSURL + `). Flags may come before or
after the arguments.
`

// outboxCmd is one invocation of shop outbox.
type outboxCmd struct {
	cfg            app.Config
	stdout, stderr io.Writer
	name           string // "shop outbox status", for messages
	json           bool
	databaseURL    string
	pools          map[string]*pgxpool.Pool
}

// runOutbox executes `shop outbox <args…>`.
func runOutbox(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, outboxUsage)
		return fmt.Errorf("outbox: missing command: %w", errUsage)
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, outboxUsage)
		return nil
	}
	cfg, err := app.LoadConfig(getenv)
	if err != nil {
		return err
	}
	c := &outboxCmd{cfg: cfg, stdout: stdout, stderr: stderr, name: "shop outbox " + sub, pools: map[string]*pgxpool.Pool{}}
	defer func() {
		for _, p := range c.pools {
			p.Close()
		}
	}()
	switch sub {
	case "status":
		return c.status(ctx, args)
	case "dead":
		return c.dead(ctx, args)
	case "show":
		return c.show(ctx, args)
	case "requeue":
		return c.requeue(ctx, args)
	case "replay":
		return c.replay(ctx, args)
	case "republish":
		return c.republish(ctx, args)
	case "dead-letters":
		if len(args) == 0 {
			return c.usageErr("missing command: list, requeue or discard")
		}
		c.name += " " + args[0]
		switch args[0] {
		case "list":
			return c.deadLettersList(ctx, args[1:])
		case "requeue":
			return c.deadLettersRequeue(ctx, args[1:])
		case "discard":
			return c.deadLettersDiscard(ctx, args[1:])
		}
		return c.usageErr("unknown command %q: want list, requeue or discard", args[0])
	case "parked":
		if len(args) == 0 {
			return c.usageErr("missing command: list or discard")
		}
		c.name += " " + args[0]
		switch args[0] {
		case "list":
			return c.parkedList(ctx, args[1:])
		case "discard":
			return c.parkedDiscard(ctx, args[1:])
		}
		return c.usageErr("unknown command %q: want list or discard", args[0])
	}
	fmt.Fprintf(stderr, "shop outbox: unknown command %q\n\n%s", sub, outboxUsage)
	return fmt.Errorf("outbox: unknown command %q: %w", sub, errUsage)
}

// usageErr prints what is wrong with the command line and returns an error
// that makes main exit 2.
func (c *outboxCmd) usageErr(format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	fmt.Fprintf(c.stderr, "%s: %s\n(shop outbox -h for help)\n", c.name, msg)
	return fmt.Errorf("%s: %s: %w", c.name, msg, errUsage)
}

// flags returns the flag set of a subcommand, with the flags every
// subcommand has.
func (c *outboxCmd) flags(operands string) *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	fs.Usage = func() {
		fmt.Fprintf(c.stderr, "Usage: %s [flags]%s\n\nFlags:\n", c.name, operands)
		fs.PrintDefaults()
	}
	fs.BoolVar(&c.json, "json", false, "print JSON for scripts instead of a table")
	fs.StringVar(&c.databaseURL, "database-url", "", "database `URL` of every service (default: DATABASE_URL)")
	return fs
}

// parse parses args, allowing flags before and after the positional
// arguments, and checks that exactly nargs of the latter were given.
func (c *outboxCmd) parse(fs *flag.FlagSet, args []string, nargs int, operands string) ([]string, error) {
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, fmt.Errorf("%s: %v: %w", c.name, err, errUsage) // the flag package has printed it
	}
	if len(pos) != nargs {
		if nargs == 0 {
			return nil, c.usageErr("unexpected arguments %q", pos)
		}
		return nil, c.usageErr("want %s, got %d argument(s) %q", strings.TrimSpace(operands), len(pos), pos)
	}
	if c.databaseURL != "" {
		c.cfg.DatabaseURL = c.databaseURL
		for _, sc := range c.cfg.Services {
			sc.DatabaseURL = ""
		}
	}
	return pos, nil
}

// parseInterleaved parses flags that may be mixed with positional
// arguments, which it returns. After "--" everything is positional.
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// serviceOf resolves a service or schema name ("order" or "orders").
func serviceOf(s string) (string, bool) {
	if slices.Contains(app.Names, s) {
		return s, true
	}
	for name, schema := range migrations.Schemas {
		if schema == s {
			return name, true
		}
	}
	return "", false
}

// services resolves the --service flag: "" or "all" is every service.
func (c *outboxCmd) services(flagValue string) ([]string, error) {
	if flagValue == "" || flagValue == "all" {
		return app.Names, nil
	}
	name, ok := serviceOf(flagValue)
	if !ok {
		return nil, c.usageErr("unknown service %q: want one of %s or all", flagValue, strings.Join(app.Names, ", "))
	}
	return []string{name}, nil
}

// pool returns the (lazily opened) pool of service's schema.
func (c *outboxCmd) pool(ctx context.Context, service string) (*pgxpool.Pool, error) {
	if p := c.pools[service]; p != nil {
		return p, nil
	}
	p, err := database.NewPool(ctx, c.cfg.DatabaseURLOf(service), migrations.Schemas[service], 2)
	if err != nil {
		return nil, err
	}
	c.pools[service] = p
	return p, nil
}

func (c *outboxCmd) printJSON(v any) error {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func newTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 4, 2, ' ', 0) }

// ---- status ----

type serviceStatus struct {
	Service              string  `json:"service"`
	Schema               string  `json:"schema"`
	Pending              int64   `json:"pending"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	Dead                 int64   `json:"dead"`
	DeadLetters          int64   `json:"dead_letters"`
	Conflicts            int64   `json:"conflicts"` // among the open dead letters
	Parked               int64   `json:"parked"`
	OldestParkedSeconds  float64 `json:"oldest_parked_seconds"`
}

func (c *outboxCmd) status(ctx context.Context, args []string) error {
	fs := c.flags("")
	service := fs.String("service", "", "only this `service` (default: all)")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	names, err := c.services(*service)
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
		s := serviceStatus{Service: name, Schema: migrations.Schemas[name], Pending: st.Pending, Dead: st.Dead,
			OldestPendingSeconds: st.OldestPending.Seconds()}
		if err := p.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE conflict_with IS NOT NULL)
			FROM dead_letters WHERE resolved_at IS NULL`).Scan(&s.DeadLetters, &s.Conflicts); err != nil {
			return fmt.Errorf("%s: count dead letters: %w", name, err)
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
	fmt.Fprintln(tw, "SERVICE\tPENDING\tOLDEST PENDING\tDEAD\tDEAD LETTERS\tCONFLICTS\tPARKED\tOLDEST PARKED")
	age := func(n int64, seconds float64) string {
		if n == 0 {
			return "-"
		}
		return roundDuration(time.Duration(seconds * float64(time.Second))).String()
	}
	for _, s := range out {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%d\t%d\t%d\t%s\n", s.Service, s.Pending, age(s.Pending, s.OldestPendingSeconds),
			s.Dead, s.DeadLetters, s.Conflicts, s.Parked, age(s.Parked, s.OldestParkedSeconds))
	}
	return tw.Flush()
}

// roundDuration keeps a duration readable.
func roundDuration(d time.Duration) time.Duration {
	switch {
	case d >= time.Minute:
		return d.Round(time.Second)
	case d >= time.Second:
		return d.Round(10 * time.Millisecond)
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond)
	}
	return d
}

// ---- show / requeue ----

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

func stateOf(r outbox.Record) string {
	switch {
	case r.PublishedAt != nil:
		return "published"
	case r.DeadAt != nil:
		return "dead"
	}
	return "pending"
}

// rawJSON returns b as a JSON value: itself when it is valid JSON, else a
// JSON string.
func rawJSON(b []byte) json.RawMessage {
	if json.Valid(b) {
		return json.RawMessage(b)
	}
	s, _ := json.Marshal(string(b))
	return s
}

// parseEventID reads an event id operand.
func (c *outboxCmd) parseEventID(s string) (uuid.UUID, error) {
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, c.usageErr("%q is not an event id (a UUID)", s)
	}
	return id, nil
}

// locate parses `<event-id> [--service S]` and finds the event: the first
// steps of show and requeue.
func (c *outboxCmd) locate(ctx context.Context, args []string) (string, outbox.Record, error) {
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
	names, err := c.services(*service)
	if err != nil {
		return "", outbox.Record{}, err
	}
	return c.find(ctx, names, id)
}

// find returns the event and the service whose outbox holds it.
func (c *outboxCmd) find(ctx context.Context, names []string, id uuid.UUID) (string, outbox.Record, error) {
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
func (c *outboxCmd) dead(ctx context.Context, args []string) error {
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
				lastErr = oneLine(*e.LastError, 80)
			}
			return fmt.Sprintf("%s\t%s\t%s %s\t%d\t%s\t%d\t%s\t%s", e.Service, e.EventID, e.AggregateType, e.AggregateID,
				e.AggregateSeq, e.EventType, e.Attempts, e.DeadAt.Format(time.RFC3339), lastErr)
		})
}

// printList prints a list command's result: as JSON with --json, else none
// when it is empty, else a table of header and one row per item.
func printList[T any](c *outboxCmd, out []T, none, header string, row func(T) string) error {
	if c.json {
		return c.printJSON(out)
	}
	if len(out) == 0 {
		fmt.Fprintln(c.stdout, none)
		return nil
	}
	tw := newTable(c.stdout)
	fmt.Fprintln(tw, header)
	for _, item := range out {
		fmt.Fprintln(tw, row(item))
	}
	return tw.Flush()
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

func (c *outboxCmd) show(ctx context.Context, args []string) error {
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
		{"service", fmt.Sprintf("%s (schema %s)", name, migrations.Schemas[name])},
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

func (c *outboxCmd) requeue(ctx context.Context, args []string) error {
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

// ---- replay ----

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

type replayJSON struct {
	Service     string `json:"service"`
	Republished int    `json:"republished"`
}

func (c *outboxCmd) replay(ctx context.Context, args []string) error {
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
	names, err := c.services(*service)
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

func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// ---- republish --lost ----

type lostJSON struct {
	Service       string    `json:"service"`
	Stream        string    `json:"stream"`
	EventID       uuid.UUID `json:"event_id"`
	EventType     string    `json:"event_type"`
	AggregateType string    `json:"aggregate_type"`
	AggregateID   string    `json:"aggregate_id"`
	AggregateSeq  int64     `json:"aggregate_seq"`
	PublishedAt   time.Time `json:"published_at"`
	Republished   bool      `json:"republished"`
}

type auditJSON struct {
	Service     string  `json:"service"`
	Stream      string  `json:"stream"`
	Published   int     `json:"published"` // events looked for
	Scanned     int     `json:"scanned"`   // stream messages read
	Lost        int     `json:"lost"`
	Republished int     `json:"republished"`
	Error       *string `json:"error"` // the stream could not be read: not audited
}

func (c *outboxCmd) republish(ctx context.Context, args []string) error {
	fs := c.flags("")
	lost := fs.Bool("lost", false, "republish the events their stream lost (required: the only kind of republish there is; replay republishes chosen ones)")
	service := fs.String("service", "", "only this `service`'s outbox and stream (default: all)")
	natsURL := fs.String("nats-url", "", "NATS server `URL` (default: NATS_URL, else "+app.DefaultNATSURL+")")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	if !*lost {
		return c.usageErr("--lost is required (to publish chosen events again, use replay)")
	}
	names, err := c.services(*service)
	if err != nil {
		return err
	}
	url := cmp.Or(*natsURL, app.OperatorNATSURL(c.cfg))
	nc, err := nats.Connect(url, append(app.AuditConnectOptions(c.cfg), nats.Name("shop outbox republish"), nats.Timeout(5*time.Second))...)
	if err != nil {
		return fmt.Errorf("%s: cannot reach NATS at %s: %w", c.name, app.MaskURL(url), err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	var pools verify.Pools
	for _, name := range names {
		p, err := c.pool(ctx, name)
		if err != nil {
			return err
		}
		switch name {
		case "order":
			pools.Order = p
		case "inventory":
			pools.Inventory = p
		case "payment":
			pools.Payment = p
		case "fulfillment":
			pools.Fulfillment = p
		}
	}
	audits, err := verify.AuditStreams(ctx, pools, js, verify.AuditConfig{Window: app.OutboxRetention, Services: names})
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	out := struct {
		Republished int         `json:"republished"`
		Lost        []lostJSON  `json:"lost"`
		Services    []auditJSON `json:"services"`
	}{Lost: []lostJSON{}}
	var unaudited []string
	for _, a := range audits {
		sum := auditJSON{Service: a.Service, Stream: a.Stream, Published: a.Published, Scanned: a.Scanned, Lost: len(a.Lost)}
		if a.Err != nil {
			msg := a.Err.Error()
			sum.Error = &msg
			unaudited = append(unaudited, fmt.Sprintf("%s (%s): %v", a.Service, a.Stream, a.Err))
		}
		var marked []uuid.UUID
		if len(a.Lost) > 0 {
			ids := make([]uuid.UUID, len(a.Lost))
			for i, l := range a.Lost {
				ids[i] = l.EventID
			}
			p, _ := c.pool(ctx, a.Service)
			if marked, err = outbox.RepublishAll(ctx, p, ids); err != nil {
				return fmt.Errorf("%s: %s: %w", c.name, a.Service, err)
			}
		}
		sum.Republished = len(marked)
		out.Republished += len(marked)
		for _, l := range a.Lost {
			out.Lost = append(out.Lost, lostJSON{Service: l.Service, Stream: l.Stream, EventID: l.EventID, EventType: l.Type,
				AggregateType: l.AggregateType, AggregateID: l.AggregateID, AggregateSeq: l.Seq, PublishedAt: l.PublishedAt,
				Republished: slices.Contains(marked, l.EventID)})
		}
		out.Services = append(out.Services, sum)
	}
	if c.json {
		if err := c.printJSON(out); err != nil {
			return err
		}
	} else {
		for _, a := range out.Services {
			if a.Error != nil {
				fmt.Fprintf(c.stdout, "%s: stream %s NOT AUDITED: %s\n", a.Service, a.Stream, *a.Error)
				continue
			}
			fmt.Fprintf(c.stdout, "%s: stream %s: %d published events looked for, %d messages read, %d lost, %d marked to be published again\n",
				a.Service, a.Stream, a.Published, a.Scanned, a.Lost, a.Republished)
			for _, l := range out.Lost {
				if l.Service != a.Service {
					continue
				}
				what := "republished"
				if !l.Republished {
					what = "skipped (no longer a published event: republished meanwhile, or deleted by retention)"
				}
				fmt.Fprintf(c.stdout, "  %s %s %s (%s %s, seq %d)\n", what, l.EventType, l.EventID, l.AggregateType, l.AggregateID, l.AggregateSeq)
			}
		}
		if len(out.Services) > 1 {
			fmt.Fprintf(c.stdout, "total: %d lost event(s) marked to be published again\n", out.Republished)
		}
	}
	if len(unaudited) > 0 {
		// What could be read was repaired; what could not is no success.
		return fmt.Errorf("%s: not audited: %s", c.name, strings.Join(unaudited, "; "))
	}
	return nil
}

// ---- dead letters ----

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

// eachService parses the flags of a list command (--service, --consumer,
// --limit; what names the things listed) and calls list for each service
// it names, with its pool.
func (c *outboxCmd) eachService(ctx context.Context, args []string, what string,
	list func(name string, p *pgxpool.Pool, consumer string, limit int) error) error {
	return c.forServices(ctx, args, what, true, list)
}

// forServices is eachService; withConsumer false leaves out --consumer,
// for the lists that no consumer owns (the outboxes' dead events).
func (c *outboxCmd) forServices(ctx context.Context, args []string, what string, withConsumer bool,
	list func(name string, p *pgxpool.Pool, consumer string, limit int) error) error {
	fs := c.flags("")
	service := fs.String("service", "", "only this `service`'s "+what+" (default: all)")
	consumer := new(string)
	if withConsumer {
		fs.StringVar(consumer, "consumer", "", "only this `consumer`'s "+what)
	}
	limit := fs.Int("limit", 100, "at most `N` per service")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	if *limit <= 0 {
		return c.usageErr("--limit %d: want a positive number", *limit)
	}
	names, err := c.services(*service)
	if err != nil {
		return err
	}
	for _, name := range names {
		p, err := c.pool(ctx, name)
		if err != nil {
			return err
		}
		if err := list(name, p, *consumer, *limit); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}

func (c *outboxCmd) deadLettersList(ctx context.Context, args []string) error {
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
				d.LastFailedAt.Format(time.RFC3339), requeued, oneLine(d.Error, 80))
		})
}

// oneLine shortens s to one line of at most n runes.
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

func (c *outboxCmd) deadLettersRequeue(ctx context.Context, args []string) error {
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
	names, err := c.services(*service)
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
