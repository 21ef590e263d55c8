//go:build shopbench

package outbox

import (
	"context"
	"testing"
)

func TestClaimAndMarkPublishesNothing(t *testing.T) {
	e := setup(t)
	var w Writer
	add(t, e.db.Pool, &w, event("o-1", "OrderCreated"), event("o-2", "OrderCreated"), event("o-3", "OrderCreated"))
	r := e.relay(t, Config{})
	n, err := r.ClaimAndMark(context.Background())
	if err != nil || n != 3 {
		t.Fatalf("ClaimAndMark = %d, %v; want 3", n, err)
	}
	if got := count(t, e.db.Pool, "published_at IS NOT NULL AND claim_token IS NULL"); got != 3 {
		t.Errorf("%d events marked published, want 3", got)
	}
	if got := streamMsgs(t, e.stream); got != 0 {
		t.Errorf("%d messages in the stream, want 0", got)
	}
}
