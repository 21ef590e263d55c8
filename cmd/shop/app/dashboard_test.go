package app

import (
	"slices"
	"testing"

	"github.com/shop-ref/shop/internal/config"
)

// The dashboard answers to the host it listens on when that names one, and
// to DASHBOARD_HOSTS; an address of every interface names none, so a
// rebinding name is not let in by it.
func TestDashboardHosts(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string][]string{
		"127.0.0.1:8080":          {"extra.example", "127.0.0.1"},
		"shop.example.com:8080":   {"extra.example", "shop.example.com"},
		"[2001:db8::1]:8080":      {"extra.example", "2001:db8::1"},
		":8080":                   {"extra.example"},
		"0.0.0.0:8080":            {"extra.example"},
		"[::]:8080":               {"extra.example"},
		"not an address, no port": {"extra.example"},
	} {
		got := dashboardHosts(config.Config{DashboardAddr: addr, DashboardHosts: []string{"extra.example"}})
		if !slices.Equal(got, want) {
			t.Errorf("DASHBOARD_ADDR %q: hosts %q, want %q", addr, got, want)
		}
	}
}
