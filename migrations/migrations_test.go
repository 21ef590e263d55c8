package migrations

import (
	"strings"
	"testing"
)

// A service without migrations is an error naming the fix, never an empty
// set that migrates "successfully" (every registered service is checked by
// registry.Validate: services.TestAllIsValid).
func TestAServiceWithoutMigrationsIsAnError(t *testing.T) {
	if err := Service("order").Err(); err != nil {
		t.Fatalf("order: %v", err)
	}
	err := Service("nosuchservice").Err()
	if err == nil || !strings.Contains(err.Error(), "migrations/nosuchservice/") {
		t.Fatalf("a service without migrations: got %v, want an error naming migrations/nosuchservice/", err)
	}
}
