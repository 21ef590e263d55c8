package config

import "github.com/shop-ref/shop/services"

// LoadConfig is LoadFor of the shop's own services, for the tests of this
// package. Only cmd/shop wires services.All into the code that runs
// (services/imports_test.go holds that rule); tests may use it.
func LoadConfig(getenv func(string) string) (Config, error) {
	return LoadFor(services.All, getenv)
}

// setting is Setting of cfg's settings.
func setting[T any](cfg Config, env string) T { return Setting[T](cfg.Settings, env) }
