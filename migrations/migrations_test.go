package migrations

import (
	"strings"
	"testing"
)

// Every service's own migrations are embedded; a service without any is an
// error naming the fix, never an empty set that migrates "successfully".
func TestEveryServiceHasEmbeddedMigrations(t *testing.T) {
	for service := range Schemas {
		if err := Service(service).Err(); err != nil {
			t.Errorf("%s: %v", service, err)
		}
	}
	err := Service("loyalty").Err()
	if err == nil || !strings.Contains(err.Error(), "migrations/loyalty/") {
		t.Fatalf("a service without migrations: got %v, want an error naming migrations/loyalty/", err)
	}
}
