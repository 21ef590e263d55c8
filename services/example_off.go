//go:build !fifthservice

package services

import "github.com/shop-ref/shop/internal/registry"

// Examples are the services in All that are not the shop's: the guide's
// fifth service, in a build with the fifthservice tag (example_on.go).
// Tests of the files a fork edits by hand for its own service
// (docker-compose.yml, deploy/nats/auth.conf, api/openapi.yaml,
// docs/events.md) skip them; every other test runs them.
var Examples registry.Registry

// BuildTags are the go build tags that give a binary this registry: a test
// that builds cmd/shop to run it as processes passes them (`go build -tags
// BuildTags`), or its processes would run another list of services than
// the test checks.
const BuildTags = ""
