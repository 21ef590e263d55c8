// Package poll is the one way the shop's tests wait for something they can
// observe: a condition polled until it holds or a deadline passes. A test
// waits for what a user can see (an API answer, a log line, a count); a
// fixed sleep instead would be too short on a loaded machine and too long
// on an idle one.
//
// The libraries under pkg/ keep a copy of their own, so that each can be
// lifted into another module alone.
package poll

import (
	"testing"
	"time"
)

// Every is how often Until evaluates its condition.
const Every = 20 * time.Millisecond

// Until calls cond every [Every] until it returns true, and fails the test
// with what it waited for if that has not happened within timeout.
func Until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(Every)
	}
}
