package migrations

import (
	"strings"
	"testing"
)

// Every service's own migrations are embedded; one left out of the
// //go:embed line is an error naming the fix, never an empty directory that
// migrates "successfully".
func TestEveryServiceHasEmbeddedMigrations(t *testing.T) {
	for service := range Schemas {
		if _, err := ServiceMigrations(service); err != nil {
			t.Errorf("%s: %v", service, err)
		}
	}
	_, err := ServiceMigrations("loyalty")
	if err == nil || !strings.Contains(err.Error(), "//go:embed") {
		t.Fatalf("a service without embedded migrations: got %v, want an error naming the //go:embed line", err)
	}
}
