package httpx_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/httpx"
)

func TestLimitBodiesNeedsItsLimits(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	for _, l := range []httpx.BodyLimits{
		{Max: 1, Logger: log},
		{Timeout: time.Second, Logger: log},
		{Timeout: time.Second, Max: 1},
	} {
		if _, err := httpx.LimitBodies(http.NotFoundHandler(), l); err == nil {
			t.Errorf("LimitBodies(%+v) accepted", l)
		}
	}
}

// The body's deadline ends with the body: a handler that works longer than
// its body may take to arrive keeps its context (and its queries). A read
// deadline that fired in net/http's background read, which watches the
// connection once the body has ended, would cancel it.
func TestBodyDeadlineEndsWithTheBody(t *testing.T) {
	t.Parallel()
	const timeout = 100 * time.Millisecond
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := httpx.ReadBody(r); err != nil {
			httpx.WriteProblem(w, r, nil, err)
			return
		}
		select {
		case <-r.Context().Done():
			http.Error(w, "the context ended while the handler worked", http.StatusInternalServerError)
		case <-time.After(5 * timeout):
			w.WriteHeader(http.StatusNoContent)
		}
	})
	limited, err := httpx.LimitBodies(httpx.Bodies(h), httpx.BodyLimits{Timeout: timeout, Max: 4, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(limited)
	defer srv.Close()
	for range 3 { // the same kept-alive connection, each time
		res, err := http.Post(srv.URL, "application/json", strings.NewReader(`{"a":1}`))
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusNoContent {
			t.Fatalf("a handler working past the body deadline: %d, want 204", res.StatusCode)
		}
	}
}
