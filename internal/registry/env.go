package registry

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"
)

// Env holds the services' own settings: each is an environment variable,
// read once when it is declared, that a command-line flag of the same name
// overrides (PAYMENT_TIMEOUT, -payment-timeout). A service declares its
// settings in its Entry's Configure; the shop reads them all at start-up, so
// a bad value stops every command before anything runs, and `shop <command>
// -h`, EnvVars and the start-up log list them without a line of the shop's
// own code per setting.
type Env struct {
	getenv func(string) string
	flags  *flag.FlagSet // holds every setting's flag.Value; copied onto each command's flag set
	vars   []setting
	errs   []error
}

type setting struct {
	env    string
	secret bool
}

// NewEnv returns an Env that reads getenv (os.Getenv in main).
func NewEnv(getenv func(string) string) *Env {
	fs := flag.NewFlagSet("settings", flag.ContinueOnError)
	fs.SetOutput(discard{})
	return &Env{getenv: getenv, flags: fs}
}

// Duration declares a positive duration.
func (e *Env) Duration(p *time.Duration, env string, def time.Duration, usage string) {
	*p = def
	e.declare(env, false, usage, &durationValue{p}, "a positive duration such as 15m or 2s")
}

// Count declares a whole number, 0 or more.
func (e *Env) Count(p *int64, env string, def int64, usage string) {
	*p = def
	e.declare(env, false, usage, &countValue{p}, "a whole number, 0 or more")
}

// Bool declares a boolean.
func (e *Env) Bool(p *bool, env string, def bool, usage string) {
	*p = def
	e.declare(env, false, usage, &boolValue{p}, "true or false")
}

// String declares a string.
func (e *Env) String(p *string, env, def, usage string) {
	*p = def
	e.declare(env, false, usage, &stringValue{p}, "")
}

// Secret declares a string that help texts and logs never show.
func (e *Env) Secret(p *string, env, def, usage string) {
	*p = def
	e.declare(env, true, usage, &secretValue{stringValue{p}}, "")
}

func (e *Env) declare(env string, secret bool, usage string, v flag.Value, want string) {
	name := FlagName(env)
	if e.flags.Lookup(name) != nil {
		e.errs = append(e.errs, fmt.Errorf("setting %s is declared twice", env))
		return
	}
	e.flags.Var(v, name, usage+" ("+env+")")
	e.vars = append(e.vars, setting{env: env, secret: secret})
	if s := e.getenv(env); s != "" {
		if err := v.Set(s); err != nil {
			e.errs = append(e.errs, fmt.Errorf("%s=%q: want %s", env, s, want))
		}
	}
}

// FlagName is the flag that overrides the variable env: PAYMENT_TIMEOUT is
// -payment-timeout.
func FlagName(env string) string { return strings.ReplaceAll(strings.ToLower(env), "_", "-") }

// Err reports every value that could not be read, each naming its variable.
func (e *Env) Err() error { return errors.Join(e.errs...) }

// Vars lists the variables declared, in order.
func (e *Env) Vars() []string {
	names := make([]string, len(e.vars))
	for i, v := range e.vars {
		names[i] = v.env
	}
	return names
}

// RegisterFlags adds each setting's flag to fs; a flag set on the command
// line then overrides the environment.
func (e *Env) RegisterFlags(fs *flag.FlagSet) {
	e.flags.VisitAll(func(f *flag.Flag) { fs.Var(f.Value, f.Name, f.Usage) })
}

// Set sets the variable env as if the environment had it: the demo turns on
// what only a demo wants (PAYMENT_FAKE_PROVIDER).
func (e *Env) Set(env, value string) error {
	if e.flags.Lookup(FlagName(env)) == nil {
		return fmt.Errorf("no service declares the setting %s", env)
	}
	return e.flags.Set(FlagName(env), value)
}

// Value returns the current value of the variable env (a time.Duration,
// int64, bool or string), and false when no service declares it: for the
// parts of the shop that read a service's setting (the reconciler the
// saga's timeouts, the demo the operator's token).
func (e *Env) Value(env string) (any, bool) {
	f := e.flags.Lookup(FlagName(env))
	if f == nil {
		return nil, false
	}
	return f.Value.(flag.Getter).Get(), true
}

// LogValue reports every setting, secrets as whether they are set.
func (e *Env) LogValue() slog.Value {
	attrs := make([]slog.Attr, 0, len(e.vars))
	for _, v := range e.vars {
		f := e.flags.Lookup(FlagName(v.env))
		key := strings.ToLower(v.env)
		if v.secret {
			attrs = append(attrs, slog.Bool(key+"_set", f.Value.String() != ""))
			continue
		}
		attrs = append(attrs, slog.Any(key, f.Value.(flag.Getter).Get()))
	}
	return slog.GroupValue(attrs...)
}

type durationValue struct{ p *time.Duration }

func (v *durationValue) String() string {
	if v.p == nil {
		return ""
	}
	return v.p.String()
}
func (v *durationValue) Get() any { return *v.p }
func (v *durationValue) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return errors.New("want a positive duration such as 15m or 2s")
	}
	*v.p = d
	return nil
}

type countValue struct{ p *int64 }

func (v *countValue) String() string {
	if v.p == nil {
		return ""
	}
	return strconv.FormatInt(*v.p, 10)
}
func (v *countValue) Get() any { return *v.p }
func (v *countValue) Set(s string) error {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return errors.New("want a whole number, 0 or more")
	}
	*v.p = n
	return nil
}

type boolValue struct{ p *bool }

func (v *boolValue) String() string {
	if v.p == nil {
		return ""
	}
	return strconv.FormatBool(*v.p)
}
func (v *boolValue) Get() any         { return *v.p }
func (v *boolValue) IsBoolFlag() bool { return true }
func (v *boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New("want true or false")
	}
	*v.p = b
	return nil
}

type stringValue struct{ p *string }

func (v *stringValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}
func (v *stringValue) Get() any           { return *v.p }
func (v *stringValue) Set(s string) error { *v.p = s; return nil }

// secretValue shows as xxxxx in help texts when set.
type secretValue struct{ stringValue }

func (v *secretValue) String() string {
	if v.p == nil || *v.p == "" {
		return ""
	}
	return "xxxxx"
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
