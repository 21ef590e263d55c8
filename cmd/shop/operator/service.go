package operator

import (
	"github.com/shop-ref/shop/internal/registry"
)

// Shop is the operator's commands for the services of Services:
// services.All in the shop binary (cmd/shop); a test may add one. Every
// command knows the services only from it, and reads only the part of
// their configuration it needs: where the schemas are (config.LoadSchemas),
// how to reach the streams, and for verify the services' settings.
type Shop struct{ Services registry.Registry }

// serviceOf resolves a service or schema name ("order" or "orders").
func serviceOf(reg registry.Registry, s string) (registry.Entry, bool) {
	for _, e := range reg {
		if e.Name == s || e.Schema == s {
			return e, true
		}
	}
	return registry.Entry{}, false
}

// schemaOf is the schema of the service called name ("order" owns "orders").
func schemaOf(reg registry.Registry, name string) string {
	e, _ := reg.Get(name)
	return e.Schema
}
