//go:build fifthservice

package services

import (
	"github.com/shop-ref/shop/examples/loyalty"
	"github.com/shop-ref/shop/internal/registry"
)

// Examples adds the guide's fifth service (examples/loyalty) to All, so
// that `make test` runs the service list's packages again with five services
// (`go test -tags fifthservice`): a test that assumed four fails there.
var Examples = registry.Registry{loyalty.Registration}
