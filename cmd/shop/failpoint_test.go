package main

import (
	"context"
	"io"
	"strings"
	"testing"

	"github.com/shop-ref/shop/internal/failpoint"
)

func TestUnknownFailpointStopsStartUp(t *testing.T) {
	err := run(context.Background(), []string{"order"}, env(map[string]string{
		failpoint.EnvVar: "outbox.after_clam=crash",
	}), io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), `unknown failpoint "outbox.after_clam"`) ||
		!strings.Contains(err.Error(), failpoint.OutboxAfterClaim) {
		t.Fatalf("run = %v; want the unknown name refused with the known ones listed", err)
	}
	if failpoint.Spec() != "" {
		t.Fatal("a refused configuration armed failpoints")
	}
}
