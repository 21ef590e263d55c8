package app

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/shop-ref/shop/internal/httpx"
)

// The HTTP limits of every server the shop runs, each service's and the
// dashboard's, so that no client holds one with a request it never
// finishes. docs/architecture.md ("HTTP limits") lists them for operators.
const (
	// ReadHeaderTimeout bounds how long a client may take to send a
	// request's line and headers, from its first byte. A well-behaved
	// client sends them in one segment; a slow one is closed without an
	// answer.
	ReadHeaderTimeout = 5 * time.Second

	// BodyTimeout bounds how long a request body may take to arrive, from
	// the end of its headers (httpx.LimitBodies). Bodies are at most 64
	// KiB, which takes well under a second on any link a shop's clients
	// use; one that has not arrived after 10 s is a client stalling on
	// purpose or a dead one. It is answered 400 unreadable-body and its
	// connection closed.
	BodyTimeout = 10 * time.Second

	// MaxReadingBodies is how many requests one server reads bodies of at
	// once; the next is answered 503 overloaded (Retry-After) without
	// being read. Each holds a goroutine, a connection and up to 64 KiB of
	// buffer: 512 of them are at most about 40 MB. A body that has arrived
	// frees its slot at once, so only clients that trickle their bodies
	// fill them, and BodyTimeout empties them again.
	MaxReadingBodies = 512

	// WriteTimeout bounds how long a service may take to answer, counted
	// from the end of a request's headers: BodyTimeout for the body, then
	// the handler's work and the answer, with room to spare (a client
	// still waiting after 30 s has most likely given up). It also cuts off
	// a client that stops reading its answer. The dashboard has none: its
	// event stream (/api/events) is open as long as the page is.
	WriteTimeout = 30 * time.Second

	// IdleTimeout is how long a kept-alive connection may wait for its next
	// request; a client that keeps connections it does not use gives them
	// back within a minute.
	IdleTimeout = 60 * time.Second

	// MaxHeaderBytes bounds a request's line and headers (net/http answers
	// more with 431). The shop's longest header is a 255-character
	// Idempotency-Key or a trace context; 64 KiB leaves room for proxies'
	// additions, where net/http's default is 1 MB per slow connection.
	MaxHeaderBytes = 64 << 10
)

// httpLimits are the values newHTTPServer applies: the constants above, or
// shorter timeouts in a test that must see them fire.
type httpLimits struct {
	header, body, write, idle time.Duration
	headerBytes, bodies       int
}

func defaultHTTPLimits() httpLimits {
	return httpLimits{
		header:      ReadHeaderTimeout,
		body:        BodyTimeout,
		write:       WriteTimeout,
		idle:        IdleTimeout,
		headerBytes: MaxHeaderBytes,
		bodies:      MaxReadingBodies,
	}
}

// newHTTPServer returns a server of h under l. h is wrapped in
// httpx.LimitBodies (the body deadline and the cap on bodies read at once)
// around httpx.Bodies (answers to oversized bodies that reach the client).
// ReadTimeout stays unset: LimitBodies gives each body its deadline from the
// end of its headers, where ReadTimeout would count from the first byte of
// the request and let slow headers eat into the body's time.
func newHTTPServer(h http.Handler, l httpLimits, log *slog.Logger) (*http.Server, error) {
	limited, err := httpx.LimitBodies(httpx.Bodies(h), httpx.BodyLimits{Timeout: l.body, Max: l.bodies, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("http server: %w", err)
	}
	return &http.Server{
		Handler:           limited,
		ReadHeaderTimeout: l.header,
		WriteTimeout:      l.write,
		IdleTimeout:       l.idle,
		MaxHeaderBytes:    l.headerBytes,
	}, nil
}

// listenerURL is the URL to call a listener at: an unspecified host (":8081",
// "0.0.0.0") is reached on the loopback address.
func listenerURL(ln net.Listener) string {
	host, port, err := net.SplitHostPort(ln.Addr().String())
	if err != nil {
		return "http://" + ln.Addr().String()
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}
