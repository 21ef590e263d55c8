package services

import (
	"strings"
	"testing"
	"testing/fstest"
)

// A service package left out of All stops every command at start-up with
// the line to add; one that is listed, or a directory without a
// Registration, does not.
func TestUnlistedNamesTheLineToAdd(t *testing.T) {
	t.Parallel()
	fsys := fstest.MapFS{
		"order/registration.go":   {Data: []byte("package order\n\nvar Registration = 1\n")},
		"loyalty/registration.go": {Data: []byte("package loyalty\n\nvar Registration = 1\n")},
		"helpers/registration.go": {Data: []byte("package helpers\n\nvar other = 1\n")},
	}
	err := unlisted(fsys, []string{"order"})
	if err == nil {
		t.Fatal("services/loyalty is not in All, and unlisted says nothing")
	}
	for _, want := range []string{"services/loyalty declares a Registration", "`loyalty.Registration,`", "services/services.go"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("unlisted: %v\nwant it to say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "order") || strings.Contains(err.Error(), "helpers") {
		t.Errorf("unlisted names a listed service or a package without a Registration: %v", err)
	}
	if err := unlisted(fsys, []string{"order", "loyalty"}); err != nil {
		t.Errorf("every service listed: %v", err)
	}
}
