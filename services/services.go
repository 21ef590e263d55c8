// Package services is the shop's registry: the one list of its services.
// Each service declares itself in its own package (its Registration, a
// registry.Entry). Only cmd/shop, the one composition root, imports this
// package: it passes All to everything that needs to know the services (a
// registry.Registry parameter), and tests may import it (imports_test.go
// holds the rule). Adding a service is its package, its migrations and one line
// here (docs/adding-a-service.md).
package services

import (
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/services/fulfillment"
	"github.com/shop-ref/shop/services/inventory"
	"github.com/shop-ref/shop/services/order"
	"github.com/shop-ref/shop/services/payment"
)

// All is every service of the shop, in start-up order, and Examples (none
// but in a build with the fifthservice tag).
var All = append(registry.Registry{
	inventory.Registration,
	order.Registration,
	payment.Registration,
	fulfillment.Registration,
}, Examples...)

// Deployed is All without its Examples: the services the files a fork
// edits by hand describe (docker-compose.yml, deploy/nats/auth.conf,
// api/openapi.yaml, docs/events.md), which the tests of those files hold
// them to.
func Deployed() registry.Registry {
	var out registry.Registry
	for _, e := range All {
		if _, err := Examples.Get(e.Name); err != nil {
			out = append(out, e)
		}
	}
	return out
}
