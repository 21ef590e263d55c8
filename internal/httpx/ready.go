package httpx

import (
	"context"
	"fmt"
	"net/http"
	"time"
)

// WaitReady polls base+"/readyz" until it answers 200 or ctx ends. A
// service's listener is up before its database answers, so whoever starts a
// shop (the demo, the tests, the benchmark) waits here rather than sending
// its first request into a 503.
func WaitReady(ctx context.Context, client *http.Client, base string) error {
	if client == nil {
		client = http.DefaultClient
	}
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/readyz", nil)
		if err != nil {
			return fmt.Errorf("wait for %s: %w", base, err)
		}
		if res, err := client.Do(req); err == nil {
			res.Body.Close()
			if res.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for %s to be ready: %w", base, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}
