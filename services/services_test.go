package services_test

import (
	"testing"

	"github.com/shop-ref/shop/services"
)

// The shop's registry is complete: every service has a name, schema, stream,
// subject prefix, address, pool size, constructor and migrations, none
// shared with another, and every consumer reads a stream some service
// owns (registry.Validate; every command checks it at start-up too).
func TestAllIsValid(t *testing.T) {
	if err := services.All.Validate(); err != nil {
		t.Fatal(err)
	}
}
