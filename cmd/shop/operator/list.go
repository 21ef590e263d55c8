package operator

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// eachService parses the flags of a list command (--service, --consumer,
// --limit; what names the things listed) and calls list for each service
// it names, with its pool.
func (c *command) eachService(ctx context.Context, args []string, what string,
	list func(name string, p *pgxpool.Pool, consumer string, limit int) error) error {
	return c.forServices(ctx, args, what, true, list)
}

// forServices is eachService; withConsumer false leaves out --consumer,
// for the lists that no consumer owns (the outboxes' dead events).
func (c *command) forServices(ctx context.Context, args []string, what string, withConsumer bool,
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
	names, err := c.resolve(*service)
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

// printList prints a list command's result: as JSON with --json, else none
// when it is empty, else a table of header and one row per item.
func printList[T any](c *command, out []T, none, header string, row func(T) string) error {
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
