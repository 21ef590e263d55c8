package app

import (
	"fmt"
	"slices"
	"strings"

	"github.com/shop-ref/shop/internal/registry"
)

// checkConsumers enforces that a built service runs exactly the consumers
// its registry entry declares. The rest of the shop knows its consumers only
// from the entries — the NATS permissions of its user, the order
// service's admission, shop verify's and the reconciler's flows, the chaos
// run — so a consumer missing from the entry would be refused by NATS or
// never checked, and a declared one that does not run would stall every
// check that waits for it.
func checkConsumers(e registry.Entry, dom registry.Domain) error {
	var declared, running []string
	for _, c := range e.Consumers {
		declared = append(declared, c.Stream+"/"+c.Name)
	}
	for _, c := range dom.Consumers() {
		running = append(running, c.Stream()+"/"+c.Name())
	}
	slices.Sort(declared)
	slices.Sort(running)
	if !slices.Equal(declared, running) {
		return fmt.Errorf("service %s runs the consumers [%s] (stream/name), but its registry entry declares [%s]: "+
			"make Consumers in services/%s/registration.go what the service builds",
			e.Name, strings.Join(running, " "), strings.Join(declared, " "), e.Name)
	}
	return nil
}
