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

// BuildTags are the go build tags that give a binary this registry: a test
// that builds cmd/shop to run it as processes passes them, or its processes
// would run another list of services than the test checks.
const BuildTags = "fifthservice"
