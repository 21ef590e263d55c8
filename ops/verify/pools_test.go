package verify_test

import (
	"strings"
	"testing"

	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/services"
)

// A check never reads another service's tables: an unknown name, or a
// service without a pool, is an error (it used to be fulfillment's pool).
func TestPoolOfUnknownServiceIsAnError(t *testing.T) {
	shop := verify.Shop{Services: services.All}
	if _, err := shop.Pool("nosuchservice"); err == nil || !strings.Contains(err.Error(), "unknown service") {
		t.Fatalf("Pool(nosuchservice) = %v, want an unknown-service error", err)
	}
	if _, err := shop.Pool("fulfillment"); err == nil {
		t.Fatal("Pool(fulfillment) without a pool: want an error")
	}
}
