package app

import (
	"github.com/shop-ref/shop/services"

	"github.com/shop-ref/shop/internal/config"
)

// LoadConfig is config.LoadFor of the shop's own services, for the tests of
// this package. Only cmd/shop wires services.All into the code that runs
// (services/imports_test.go holds that rule); tests may use it.
func LoadConfig(getenv func(string) string) (config.Config, error) {
	return config.LoadFor(services.All, getenv)
}
