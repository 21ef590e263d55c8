// Command pageshot opens a page in headless Chromium, as a visitor's browser
// does (scripts, fetches and all), waits until an element matching a CSS
// selector is visible, and saves a screenshot of the whole page.
// scripts/compose-check.sh runs it to see a demo order on the dashboard that
// docker compose serves:
//
//	go run ./proof/pageshot -url http://127.0.0.1:8080/ \
//	    -wait 'li.card[data-order-id="…"][data-status="COMPLETED"]' -out dashboard.png
//
// It exits 1, saying which, when Chromium cannot start, the page cannot be
// loaded or the element is not visible within -timeout; a screenshot of the
// page as it was is still saved then, to show what was there instead.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/shop-ref/shop/proof/browser"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "pageshot:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("pageshot", flag.ContinueOnError)
	url := fs.String("url", "", "the page")
	wait := fs.String("wait", "body", "CSS selector of an element that must become visible")
	out := fs.String("out", "page.png", "where the screenshot goes (PNG)")
	timeout := fs.Duration("timeout", time.Minute, "how long to wait for the page and the element")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *url == "" {
		return errors.New("-url is required")
	}
	chromium, err := browser.Find()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "pageshot-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	alloc, cancel := browser.Allocator(context.Background(), chromium, dir, 1400, 1000)
	defer cancel()
	tab, cancel := chromedp.NewContext(alloc)
	defer cancel()
	// The first call starts the browser, and must have no deadline: its
	// context's end stops the browser.
	if err := chromedp.Do(tab); err != nil {
		return fmt.Errorf("start chromium: %w", err)
	}

	ctx, cancel := context.WithTimeout(tab, *timeout)
	defer cancel()
	waitErr := chromedp.Do(ctx, chromedp.Navigate(*url), chromedp.WaitVisible(chromedp.CSS(*wait)))

	// The screenshot is taken either way, on a context of its own: the
	// page as it was when the element did not come is the evidence.
	shotCtx, cancel := context.WithTimeout(tab, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(shotCtx, chromedp.FullScreenshot(100))
	if err != nil {
		return errors.Join(waitErr, fmt.Errorf("screenshot of %s: %w", *url, err))
	}
	if err := os.WriteFile(*out, png, 0o644); err != nil {
		return errors.Join(waitErr, err)
	}
	if waitErr != nil {
		return fmt.Errorf("%s: no visible %q within %v (screenshot of the page as it was: %s): %w", *url, *wait, *timeout, *out, waitErr)
	}
	return nil
}
