package loadgen

import (
	"context"
	"io"

	"github.com/shop-ref/shop/services"
)

// Run is `shop loadgen` as cmd/shop wires it, over the shop's own services.
func Run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	return Command{Services: services.All}.Run(ctx, args, getenv, stdout, stderr)
}
