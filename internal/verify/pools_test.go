package verify

import (
	"strings"
	"testing"
)

// A check never reads another service's tables: an unknown name, or a
// service without a pool, is an error (it used to be fulfillment's pool).
func TestPoolsOfUnknownServiceIsAnError(t *testing.T) {
	var p Pools
	if _, err := p.Of("loyalty"); err == nil || !strings.Contains(err.Error(), "unknown service") {
		t.Fatalf("Of(loyalty) = %v, want an unknown-service error", err)
	}
	if _, err := p.Of("fulfillment"); err == nil {
		t.Fatal("Of(fulfillment) without a pool: want an error")
	}
}
