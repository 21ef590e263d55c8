// Package cli is what the commands of the shop binary share: the error that
// marks a command line as a usage mistake, and the flag set of the commands
// that take a configuration (the services the whole of it, migrate and
// verify the part they need).
//
// A command is a function of ctx, its arguments, the environment (getenv)
// and its two outputs that returns an error; cmd/shop turns the error into
// the exit status, so a command never exits and a test runs a command line
// without a process.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
)

// ErrUsage marks a command line the command does not understand. The
// command has already said what is wrong on its stderr; shop exits 2 and
// prints nothing more.
var ErrUsage = errors.New("usage")

// Config is a command's configuration, which adds a flag for each of its
// settings (config.Config, config.Schemas, or a command's own small one): a
// command takes the few settings it needs, and has flags for those alone.
type Config interface{ RegisterFlags(fs *flag.FlagSet) }

// ConfigFlags returns the flag set of command name ("shop verify"), with a
// flag for every setting of cfg (each overrides its environment variable)
// and a usage text of the synopsis (name, "[flags]", then operands), help,
// and the flags. The command adds its own flags before parsing: they exist
// for it alone, so another command's flag is a usage error rather than a
// flag accepted and ignored.
func ConfigFlags(name, operands, help string, cfg Config, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: %s [flags]%s\n\n", name, operands)
		fmt.Fprint(stderr, help)
		fmt.Fprint(stderr, "Flags (each overrides the environment variable named beside it):\n")
		fs.PrintDefaults()
	}
	cfg.RegisterFlags(fs)
	return fs
}

// Parse parses args with fs. -h is flag.ErrHelp (the usage printed; shop
// exits 0); any other mistake is ErrUsage, which the flag package has
// already printed.
func Parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%s: %v: %w", fs.Name(), err, ErrUsage)
	}
	return nil
}
