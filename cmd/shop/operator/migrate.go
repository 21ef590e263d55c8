package operator

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/cli"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/registry"
)

// migrateHelp is the part of `shop migrate -h` that flags cannot say.
const migrateHelp = `Migrations run as the owner of the schemas: DATABASE_URL (or <SERVICE>_DATABASE_URL)
must name an administrative role here, never a service's role.

With -roles, after migrating, each named service gets a LOGIN role of its own,
shop_order, shop_inventory, shop_payment, shop_fulfillment, that may use its own
schema only: USAGE on it, SELECT/INSERT/UPDATE/DELETE on its tables, USAGE/SELECT
on its sequences, the same on tables later migrations add (default privileges);
no CREATE anywhere, nothing on the other services' schemas. Running it again is
safe: it re-grants and sets the password again. The passwords come from
ORDER_ROLE_PASSWORD, INVENTORY_ROLE_PASSWORD, PAYMENT_ROLE_PASSWORD and
FULFILLMENT_ROLE_PASSWORD, else SHOP_ROLE_PASSWORD for all (a demo); they are
sent as SCRAM verifiers and never logged. Then run each service with its role:
  ORDER_DATABASE_URL=postgres://shop_order:<password>@host:5432/shop shop order
A service started with its role does not migrate; it checks that nothing is pending.

`

// Migrate is `shop migrate [-roles] [service…]`: it applies the migrations
// of the named services (all when none is named), one after the other,
// creating the database when it does not exist; then, with -roles, it
// creates or updates each one's role. An unknown service, or a missing
// password with -roles, stops it before anything is changed.
func (s Shop) Migrate(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	// Only where the schemas are: a setting of the services' that does not
	// parse stops them, not their migrations.
	schemas, err := config.LoadSchemas(s.Services, getenv)
	if err != nil {
		return err
	}
	var roles bool
	fs := cli.ConfigFlags("shop migrate", " [service…]", migrateHelp, &schemas, stderr)
	fs.BoolVar(&roles, "roles", false, "also create or update each service's database role shop_<service> (passwords from <SERVICE>_ROLE_PASSWORD or SHOP_ROLE_PASSWORD)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))

	names := fs.Args()
	if len(names) == 0 {
		names = schemas.Registry.Names()
	}
	entries := make([]registry.Entry, len(names))
	for i, name := range names {
		e, err := schemas.Registry.Get(name)
		if err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
		entries[i] = e
	}
	passwords := map[string]string{}
	if roles { // every password first: fail before changing anything
		for _, name := range names {
			pw, err := app.RolePassword(getenv, name)
			if err != nil {
				return fmt.Errorf("migrate -roles: %w", err)
			}
			passwords[name] = pw
		}
	}
	for _, e := range entries {
		if err := app.Migrate(ctx, schemas.DatabaseURLOf(e.Name), e, log.With("service", e.Name)); err != nil {
			return err
		}
	}
	if roles {
		for _, name := range names {
			err := app.CreateRole(ctx, schemas, name, app.RoleName(name), passwords[name], log.With("service", name))
			if err != nil {
				return fmt.Errorf("migrate -roles: %w", err)
			}
		}
	}
	return nil
}
