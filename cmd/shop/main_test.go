package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"testing"

	"github.com/shop-ref/shop/cmd/shop/operator"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/services"
)

// errUsage is what a command line shop does not understand returns.
var errUsage = cli.ErrUsage

// env is a process environment for run.
func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

func TestUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args    []string
		wantErr error
	}{
		{nil, errUsage},
		{[]string{"shipping"}, errUsage},
		{[]string{"outbox"}, errUsage},
		{[]string{"slots"}, errUsage},
		{[]string{"slots", "nuke"}, errUsage},
		{[]string{"loadgen", "-orders", "0"}, errUsage},
		{[]string{"trace"}, errUsage},
		{[]string{"trace", "not-an-order-id"}, errUsage},
		{[]string{"trace", "-h"}, flag.ErrHelp},
		{[]string{"-h"}, nil},
		{[]string{"order", "-h"}, flag.ErrHelp}, // main exits 0 on it
		{[]string{"order", "-no-such-flag"}, errUsage},
		{[]string{"all", "extra"}, errUsage},
		{[]string{"order", "-demo"}, errUsage},     // another command's flag is refused, not ignored
		{[]string{"verify", "-roles"}, errUsage},   // likewise
		{[]string{"migrate", "-repair"}, errUsage}, // likewise
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			var out strings.Builder
			err := run(context.Background(), tc.args, env(nil), &out, &out)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("err = %v, want %v", err, tc.wantErr)
			}
			if out.Len() == 0 {
				t.Error("printed nothing; want usage or an explanation")
			}
		})
	}
}

// Every command of the usage text is dispatched: its -h is help, not an
// unknown command.
func TestEveryCommandIsDispatched(t *testing.T) {
	t.Parallel()
	operators := []string{"all", "dashboard", "migrate", "verify", "outbox", "slots", "trace", "loadgen"}
	for _, name := range append(operators, services.All.Names()...) {
		if !strings.Contains(usage, name) {
			t.Errorf("the usage text does not name %s", name)
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var out strings.Builder
			err := run(context.Background(), []string{name, "-h"}, env(nil), &out, &out)
			if err != nil && !errors.Is(err, flag.ErrHelp) {
				t.Fatalf("shop %s -h: %v\n%s", name, err, out.String())
			}
			if strings.Contains(out.String(), "unknown command") || !strings.Contains(out.String(), "Usage: shop "+name) {
				t.Errorf("shop %s -h printed no usage of its own:\n%s", name, out.String())
			}
		})
	}
}

// A variable for a service that is not in services.All (its package left
// out of the registry) is a warning at start-up naming the service and the
// line to add; the shop's own variables are not.
func TestUnknownServiceIsAWarning(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	warnUnknownServices([]string{"NOSUCHSERVICE_ADDR=:8090", "ORDER_ADDR=:8081", "DASHBOARD_ADDR=:8080"}, &out)
	log := out.String()
	for _, want := range []string{"level=WARN", "var=NOSUCHSERVICE_ADDR", "service=nosuchservice", "nosuchservice.Registration,", "services/services.go"} {
		if !strings.Contains(log, want) {
			t.Errorf("the warning does not say %q:\n%s", want, log)
		}
	}
	if n := strings.Count(log, "\n"); n != 1 {
		t.Errorf("%d lines, want one warning:\n%s", n, log)
	}
}

func TestExitCode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err     error
		want    int
		printed bool
	}{
		{nil, 0, false},
		{flag.ErrHelp, 0, false},
		{fmt.Errorf("shop outbox status: bad: %w", cli.ErrUsage), 2, false}, // the command has said why
		{operator.ErrViolations, 1, false},                                  // the report says why
		{errors.New("cannot reach the database"), 1, true},
	} {
		var stderr strings.Builder
		if got := exitCode(tc.err, &stderr); got != tc.want {
			t.Errorf("exitCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
		if printed := stderr.Len() > 0; printed != tc.printed {
			t.Errorf("exitCode(%v) printed %q", tc.err, stderr.String())
		}
	}
}
