package app

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services/inventory"
)

// An inventory process without OPERATOR_TOKEN says that its restock is
// open, as the payment process says the demo's webhook secret is public;
// one with a token says nothing of it, and never logs the token.
func TestInventoryWarnsWithoutAnOperatorToken(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, inventory.Registration.Sets()...)
	_, js := natstest.New(t).Connect(t)
	for _, token := range []string{"", "op-s3cret"} {
		var out logbuf.Buffer
		cfg, err := LoadConfig(func(k string) string { return map[string]string{"OPERATOR_TOKEN": token}[k] })
		if err != nil {
			t.Fatal(err)
		}
		log := slog.New(slog.NewTextHandler(&out, nil))
		buildDomain(t, cfg, "inventory", registry.Deps{Pool: db.Pool, JetStream: js, Logger: log})
		log.Info("config", "config", cfg)
		warned := strings.Contains(out.String(), "OPERATOR_TOKEN is not set")
		if warned != (token == "") {
			t.Errorf("token %q: warned %v; log:\n%s", token, warned, out.String())
		}
		if strings.Contains(out.String(), "op-s3cret") {
			t.Errorf("the token is logged:\n%s", out.String())
		}
	}
}
