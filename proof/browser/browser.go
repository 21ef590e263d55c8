// Package browser starts headless Chromium the one way this machine kind
// allows, for the tests and tools that look at the dashboard as a visitor
// does (ops/dashboard's TestBrowser, proof/pageshot).
package browser

import (
	"context"
	"errors"
	"os/exec"

	"github.com/chromedp/chromedp"
)

// Find returns Chromium's path, or an error saying how to install it.
func Find() (string, error) {
	for _, name := range []string{"chromium", "chromium-browser"} {
		if path, err := exec.LookPath(name); err == nil {
			return path, nil
		}
	}
	return "", errors.New("no Chromium on PATH: install it with apt-get update && apt-get install -y chromium, " +
		"or run scripts/ensure-chromium.sh (make test does)")
}

// Allocator is a chromedp allocator of a headless Chromium at path, with
// its profile in dir and a window of width×height. As root, Chromium's
// sandbox refuses to start; without the networking flags it reaches for
// hosts this machine cannot reach, many at a time.
func Allocator(ctx context.Context, path, dir string, width, height int) (context.Context, context.CancelFunc) {
	return chromedp.NewExecAllocator(ctx,
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(dir),
		chromedp.WindowSize(width, height),
	)
}
