package operator

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/database"
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
--nats-url URL (NATS_URL, default ` + config.DefaultNATSURL + `). Flags may come before or
after the arguments.
`

// Outbox is `shop outbox <command> [flags] [arguments]`; args starts with
// the command. Each command (status.go, event.go, replay.go, republish.go,
// deadletter.go, parked.go) parses its own flags.
func (s Shop) Outbox(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, outboxUsage)
		return fmt.Errorf("outbox: missing command: %w", cli.ErrUsage)
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, outboxUsage)
		return nil
	}
	c, err := s.newCommand("shop outbox "+sub, getenv, stdout, stderr)
	if err != nil {
		return err
	}
	defer c.close()
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
	return fmt.Errorf("outbox: unknown command %q: %w", sub, cli.ErrUsage)
}

// command is one invocation of an operator command that reads the
// services' tables (shop outbox …, shop trace): its outputs, the flags
// every such command has, and the pools it has opened, one per service,
// closed by close.
type command struct {
	schemas        config.Schemas // where each service's tables are
	natsURL        string         // NATS_URL (republish); empty: app.OperatorNATSURL finds the server
	auditPassword  string         // AUDIT_NATS_PASSWORD (republish)
	stdout, stderr io.Writer
	name           string // "shop outbox status", for messages
	help           string // the command line that prints the help; default "shop outbox -h"
	json           bool
	databaseURL    string
	pools          map[string]*pgxpool.Pool
}

// newCommand reads what the operator's commands need of the configuration
// from the environment for command name: where the schemas are and how to
// read the streams, nothing more.
func (s Shop) newCommand(name string, getenv func(string) string, stdout, stderr io.Writer) (*command, error) {
	schemas, err := config.LoadSchemas(s.Services, getenv)
	if err != nil {
		return nil, err
	}
	return &command{schemas: schemas, natsURL: getenv("NATS_URL"), auditPassword: getenv(broker.PasswordVar(broker.AuditUser)), stdout: stdout, stderr: stderr, name: name, pools: map[string]*pgxpool.Pool{}}, nil
}

// close closes the pools the command opened.
func (c *command) close() {
	for _, p := range c.pools {
		p.Close()
	}
}

// usageErr prints what is wrong with the command line and returns an error
// that makes shop exit 2.
func (c *command) usageErr(format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	help := c.help
	if help == "" {
		help = "shop outbox -h"
	}
	fmt.Fprintf(c.stderr, "%s: %s\n(%s for help)\n", c.name, msg, help)
	return fmt.Errorf("%s: %s: %w", c.name, msg, cli.ErrUsage)
}

// flags returns the flag set of a command, with the flags every command
// has; operands follow "[flags]" in its usage line.
func (c *command) flags(operands string) *flag.FlagSet {
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
func (c *command) parse(fs *flag.FlagSet, args []string, nargs int, operands string) ([]string, error) {
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, fmt.Errorf("%s: %v: %w", c.name, err, cli.ErrUsage) // the flag package has printed it
	}
	if len(pos) != nargs {
		if nargs == 0 {
			return nil, c.usageErr("unexpected arguments %q", pos)
		}
		return nil, c.usageErr("want %s, got %d argument(s) %q", strings.TrimSpace(operands), len(pos), pos)
	}
	if c.databaseURL != "" {
		c.schemas.DatabaseURL = c.databaseURL
		for name := range c.schemas.Own {
			c.schemas.Own[name] = ""
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

// resolve resolves the --service flag: "" or "all" is every service.
func (c *command) resolve(flagValue string) ([]string, error) {
	if flagValue == "" || flagValue == "all" {
		return c.schemas.Registry.Names(), nil
	}
	e, ok := serviceOf(c.schemas.Registry, flagValue)
	if !ok {
		return nil, c.usageErr("unknown service %q: want one of %s or all", flagValue, strings.Join(c.schemas.Registry.Names(), ", "))
	}
	name := e.Name
	return []string{name}, nil
}

// pool returns the (lazily opened) pool of service's schema.
func (c *command) pool(ctx context.Context, service string) (*pgxpool.Pool, error) {
	if p := c.pools[service]; p != nil {
		return p, nil
	}
	e, err := c.schemas.Registry.Get(service)
	if err != nil {
		return nil, err
	}
	p, err := database.NewPool(ctx, c.schemas.DatabaseURLOf(service), e.Schema, 2)
	if err != nil {
		return nil, err
	}
	c.pools[service] = p
	return p, nil
}
