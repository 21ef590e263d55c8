package operator

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/services"
)

// run runs an operator command line, as shop does after its first word
// (outbox, trace, verify, migrate, slots) names the command.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	op := Shop{Services: services.All}
	commands := map[string]func(context.Context, []string, func(string) string, io.Writer, io.Writer) error{
		"outbox": op.Outbox, "trace": op.Trace, "verify": op.Verify, "migrate": op.Migrate, "slots": op.Slots,
	}
	cmd, ok := commands[args[0]]
	if !ok {
		return fmt.Errorf("no operator command %q", args[0])
	}
	return cmd(ctx, args[1:], getenv, stdout, stderr)
}

// errUsage is cli.ErrUsage, by a name that the tests' shopCLI values,
// called cli, do not shadow.
var errUsage = cli.ErrUsage

// env is a process environment for run.
func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

// shopCLI runs shop command lines against one database.
type shopCLI struct {
	t    *testing.T
	vars func(string) string
}

// run runs args and returns stdout, stderr and the error.
func (c shopCLI) run(args ...string) (string, string, error) {
	c.t.Helper()
	var out, errOut strings.Builder
	err := run(context.Background(), args, c.vars, &out, &errOut)
	return out.String(), errOut.String(), err
}

// ok runs args, fails the test on an error and returns stdout.
func (c shopCLI) ok(args ...string) string {
	c.t.Helper()
	out, errOut, err := c.run(args...)
	if err != nil {
		c.t.Fatalf("shop %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, out, errOut)
	}
	return out
}

// json runs args and decodes its stdout into v.
func (c shopCLI) json(v any, args ...string) {
	c.t.Helper()
	out := c.ok(args...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		c.t.Fatalf("shop %s: output is not JSON: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// shopStreams starts a NATS server with the shop's four streams, as the
// services create them, and returns its URL and a JetStream client.
func shopStreams(t *testing.T) (string, jetstream.JetStream) {
	t.Helper()
	ns := natstest.New(t)
	_, js := ns.Connect(t)
	for name, subjects := range map[string]string{"ORDERS": "orders.>", "INVENTORY": "inventory.>", "PAYMENT": "payment.>", "FULFILLMENT": "fulfillment.>"} {
		ns.Stream(t, js, name, subjects)
	}
	return ns.URL(), js
}

// compact removes the indentation of --json output.
func compact(raw []byte) string {
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return "invalid JSON: " + err.Error()
	}
	return b.String()
}

func jsonNumber(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}
