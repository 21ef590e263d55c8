package failpoint_test

import (
	"slices"
	"testing"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/saga"
)

// The libraries cannot import this package, so they spell their failpoint
// names themselves; every one must be in the registry, or Init would refuse
// the name of a point that exists.
func TestLibraryNamesAreRegistered(t *testing.T) {
	for _, n := range []string{
		outbox.FailpointAfterClaim, outbox.FailpointBeforePublish, outbox.FailpointAfterAckBeforeMark,
		outbox.FailpointRetentionMidBatch, inbox.FailpointBeforeCommit, inbox.FailpointAfterCommitBeforeAck,
		saga.FailpointAfterClaimTimeout,
	} {
		if !slices.Contains(failpoint.Names(), n) {
			t.Errorf("library failpoint %q is not in failpoint.Names()", n)
		}
	}
}
