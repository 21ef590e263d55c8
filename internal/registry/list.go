package registry

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/shop-ref/shop/internal/broker"
)

// Registry is every service of a shop, in start-up order (a consumer's
// producer need not start first: consumers wait for their streams).
type Registry []Entry

// Names lists the services' names, in order.
func (r Registry) Names() []string {
	names := make([]string, len(r))
	for i, e := range r {
		names[i] = e.Name
	}
	return names
}

// Get returns the service called name. An unknown name is an error, never
// another service's entry.
func (r Registry) Get(name string) (Entry, error) {
	for _, e := range r {
		if e.Name == name {
			return e, nil
		}
	}
	return Entry{}, fmt.Errorf("unknown service %q (want one of %s)", name, strings.Join(r.Names(), ", "))
}

// Owner returns the service whose stream is stream.
func (r Registry) Owner(stream string) (Entry, bool) {
	for _, e := range r {
		if e.Stream == stream {
			return e, true
		}
	}
	return Entry{}, false
}

// Readers lists every consumer of the shop with the service that runs it.
func (r Registry) Readers() []Reader {
	var readers []Reader
	for _, e := range r {
		for _, c := range e.Consumers {
			readers = append(readers, Reader{Service: e.Name, Consumer: c})
		}
	}
	return readers
}

var (
	validName   = regexp.MustCompile(`^[a-z][a-z0-9]*$`)
	validToken  = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)
	validStream = regexp.MustCompile(`^[A-Z][A-Z0-9_]*$`)
)

// Validate checks every entry and their consistency with each other, and
// reports every problem it finds, each saying what to add and where.
func (r Registry) Validate() error {
	var errs []error
	fail := func(e Entry, format string, args ...any) {
		where := fmt.Sprintf("services/%s/registration.go", e.Name)
		errs = append(errs, fmt.Errorf("service %q: %s (in its Entry, %s)", e.Name, fmt.Sprintf(format, args...), where))
	}
	seen := map[string]string{} // "kind value" → service
	unique := func(e Entry, kind, value string) {
		key := kind + " " + value
		if other, ok := seen[key]; ok {
			fail(e, "%s %q is %s's too", kind, value, other)
		}
		seen[key] = e.Name
	}
	for _, e := range r {
		if !validName.MatchString(e.Name) {
			fail(e, "Name must be lower case letters and digits: it names the command, the NATS user and the <NAME>_ variables")
		}
		if slices.Contains(broker.SystemUsers(), e.Name) {
			// Its NATS user would be the shop's own of that name: two
			// permission sets for one user, and its password variable
			// (<NAME>_NATS_PASSWORD) the system user's.
			fail(e, "Name %q is reserved: the shop's NATS user %q has it (reserved: %s); pick another",
				e.Name, e.Name, strings.Join(broker.SystemUsers(), ", "))
		}
		unique(e, "Name", e.Name)
		if e.Schema == "" {
			fail(e, "no Schema: name the Postgres schema it owns")
		}
		unique(e, "Schema", e.Schema)
		if !validStream.MatchString(e.Stream) {
			fail(e, "Stream %q: name the JetStream stream it publishes to, in capitals (ORDERS)", e.Stream)
		}
		unique(e, "Stream", e.Stream)
		switch {
		case strings.HasPrefix(e.Prefix, "_") || strings.HasPrefix(e.Prefix, "$"):
			// The service's user may publish to <Prefix>.>: with _INBOX it
			// could answer into every other user's replies, with $JS or
			// $SYS call the server's own APIs.
			fail(e, "Prefix %q is reserved: NATS keeps subjects beginning with _ or $ for itself (_INBOX replies, the $JS API); "+
				"name the first token of its subjects in letters (orders)", e.Prefix)
		case !validToken.MatchString(e.Prefix):
			fail(e, "Prefix %q: name the first token of its subjects (orders)", e.Prefix)
		}
		unique(e, "Prefix", e.Prefix)
		if e.Addr == "" {
			// Without one it would listen on a random port, and nothing
			// (compose, the demo's seeding, the dashboard) would find it.
			fail(e, "no default HTTP address: set Addr (\":8085\"), unique in the shop")
		}
		unique(e, "Addr", e.Addr)
		if e.PoolSize <= 0 {
			fail(e, "no PoolSize: its consumers' Workers+2 each, the relay's 3, and room for HTTP")
		}
		if e.Configure == nil {
			fail(e, "no Configure: it returns the service's constructor")
		}
		if sets := e.Sets(); sets[len(sets)-1].Err() != nil {
			fail(e, "%v", sets[len(sets)-1].Err())
		}
		for _, c := range e.Consumers {
			if c.Name == "" || strings.ContainsAny(c.Name, " \t.*>/") {
				fail(e, "consumer %q: a durable name without whitespace, '.', '*', '>' or '/' (%s-<stream read>)", c.Name, e.Name)
			}
			unique(e, "consumer", c.Name)
			if _, ok := r.Owner(c.Stream); !ok {
				fail(e, "consumer %s reads stream %q, which no service in services.All publishes to", c.Name, c.Stream)
			}
		}
		for _, c := range e.Checks {
			if c.From != nil && !slices.Contains(r.Names(), c.From.Service) {
				fail(e, "check %q reads service %q, which is not in services.All", c.Name, c.From.Service)
			}
		}
	}
	return errors.Join(errs...)
}

// Access lists what every service does on NATS, for its user's
// permissions (broker.Users).
func (r Registry) Access() []broker.Access {
	access := make([]broker.Access, len(r))
	for i, e := range r {
		access[i] = e.Access()
	}
	return access
}
