package app

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/shop-ref/shop/proof/apitest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services/inventory"
)

// limitedServer is the inventory service's handler, assembled as Run
// assembles it, served by newHTTPServer under some limits on a loopback
// port.
type limitedServer struct {
	addr   string
	client *http.Client // checks every answer against api/openapi.yaml
	active atomic.Int64 // requests whose first byte the server has read
}

func startLimited(t *testing.T, l httpLimits) *limitedServer {
	t.Helper()
	ns := natstest.New(t)
	nc, js := ns.Connect(t)
	cfg, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	router := assembled(t, inventory.Registration, cfg, nc, js, log)
	srv, err := newHTTPServer(router, l, log)
	if err != nil {
		t.Fatal(err)
	}
	s := &limitedServer{}
	srv.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateActive {
			s.active.Add(1)
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.addr = ln.Addr().String()
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })

	checker, err := apitest.New()
	if err != nil {
		t.Fatal(err)
	}
	transport := &http.Transport{}
	s.client = &http.Client{Transport: checker.Transport(transport), Timeout: time.Minute}
	t.Cleanup(transport.CloseIdleConnections)
	return s
}

// do sends one request through the checking client.
func (s *limitedServer) do(t *testing.T, method, path, body string) (*http.Response, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest(method, "http://"+s.addr+path, strings.NewReader(body))
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	res, err := s.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	var v map[string]any
	_ = json.NewDecoder(res.Body).Decode(&v)
	return res, v
}

// slowBody opens a connection that sends the head of a restock and 10 of
// the 100 bytes its Content-Length declares, then nothing.
func (s *limitedServer) slowBody(t *testing.T) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", s.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	head := "PUT /stock/SKU-SLOW HTTP/1.1\r\nHost: shop\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
	if _, err := io.WriteString(conn, head+`{"on_hand"`); err != nil {
		t.Fatal(err)
	}
	return conn
}

// cutOff reads what the server sends on conn until it closes it: the
// connection must end (EOF or reset) within wait, after the answer want
// (0: none at all). After the answer the client sends the rest of its body
// late, as a stalled client may: were the connection kept, the server would
// read it as the next request and answer that too. It returns what went
// wrong, or nil.
func cutOff(conn net.Conn, want int, wait time.Duration) error {
	_ = conn.SetReadDeadline(time.Now().Add(wait))
	rd := bufio.NewReader(conn)
	if want != 0 {
		res, err := http.ReadResponse(rd, nil)
		if err != nil {
			return fmt.Errorf("no answer: %w", err)
		}
		var p struct{ Code string }
		err = json.NewDecoder(res.Body).Decode(&p)
		res.Body.Close()
		if res.StatusCode != want || res.Header.Get("Content-Type") != "application/problem+json" || err != nil {
			return fmt.Errorf("answered %d %q %q (%v), want %d problem+json", res.StatusCode, res.Header.Get("Content-Type"), p.Code, err, want)
		}
		// The 90 bytes the head declared and never sent; a closed
		// connection may refuse them, which is the point.
		_, _ = io.WriteString(conn, `:1,"price":1}`+strings.Repeat(" ", 77))
	}
	n, err := io.Copy(io.Discard, rd)
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		return fmt.Errorf("still open after %s", wait)
	case err != nil && !errors.Is(err, syscall.ECONNRESET):
		return fmt.Errorf("reading to the end: %w", err)
	case n != 0:
		return fmt.Errorf("%d more bytes after the answer: the connection was kept and the rest of the body read as a request", n)
	}
	return nil
}

// Slow clients cannot hold a server. 300 connections each send 10 of the
// 100 bytes their Content-Length declares and stall: meanwhile a restock
// and a read are served, and each slow one is answered 400
// unreadable-body and closed once the body deadline passes (the issue found
// 300 such connections all held open for 135 s and more). Headers that
// stall are closed without an answer; an idle kept-alive connection is
// closed after the idle timeout. Only outcomes are asserted: every deadline
// is given a minute more before the test calls a connection held.
func TestSlowClientsAreCutOff(t *testing.T) {
	t.Parallel()
	l := defaultHTTPLimits()
	l.header, l.body, l.idle = time.Second, 2*time.Second, time.Second
	s := startLimited(t, l)
	const slow = 300
	const grace = time.Minute

	conns := make([]net.Conn, slow)
	for i := range conns {
		conns[i] = s.slowBody(t)
	}
	// Every slow request is in the server, body unfinished, before the
	// normal ones are sent.
	poll.Until(t, time.Minute, "the server to read all slow requests", func() bool { return s.active.Load() >= slow })

	t.Run("a normal request is served meanwhile", func(t *testing.T) {
		if res, v := s.do(t, http.MethodPut, "/stock/SKU-1", `{"on_hand":5,"price":100}`); res.StatusCode != http.StatusOK || v["on_hand"] != float64(5) {
			t.Fatalf("PUT /stock/SKU-1 beside %d slow bodies: %d %v", slow, res.StatusCode, v)
		}
		if res, v := s.do(t, http.MethodGet, "/stock/SKU-1", ""); res.StatusCode != http.StatusOK || v["on_hand"] != float64(5) {
			t.Fatalf("GET /stock/SKU-1 beside %d slow bodies: %d %v", slow, res.StatusCode, v)
		}
	})

	t.Run("every slow body is answered 400 and closed", func(t *testing.T) {
		errs := make(chan error, slow)
		var wg sync.WaitGroup
		for i, conn := range conns {
			wg.Go(func() {
				if err := cutOff(conn, http.StatusBadRequest, l.body+grace); err != nil {
					errs <- fmt.Errorf("slow connection %d: %w", i, err)
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})

	t.Run("stalled headers are closed without an answer", func(t *testing.T) {
		conn, err := net.Dial("tcp", s.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := io.WriteString(conn, "GET /stock/SKU-1 HTTP/1.1\r\nHost: sh"); err != nil {
			t.Fatal(err)
		}
		if err := cutOff(conn, 0, l.header+grace); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("an idle connection is closed", func(t *testing.T) {
		conn, err := net.Dial("tcp", s.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: shop\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		rd := bufio.NewReader(conn)
		res, err := http.ReadResponse(rd, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusOK || res.Close {
			t.Fatalf("GET /healthz: %d, close %v; want 200 on a kept-alive connection", res.StatusCode, res.Close)
		}
		_ = conn.SetReadDeadline(time.Now().Add(l.idle + grace))
		if n, err := io.Copy(io.Discard, rd); err != nil || n != 0 {
			t.Fatalf("the idle connection: %d bytes, %v; want it closed", n, err)
		}
	})
}

// Over the cap on bodies read at once, a request with a body is answered
// 503 overloaded with Retry-After and Connection: close at once, its body
// unread; one without a body is served as always; and once the slow bodies
// are gone, bodies are read again. The slow bodies may take a minute: with
// the 2 s of the test before, a loaded machine's first restock came after
// the server had cut them off, and none was refused. TestSlowClientsAreCutOff
// checks that the server cuts slow bodies off.
func TestBodiesOverTheCapAre503(t *testing.T) {
	t.Parallel()
	l := defaultHTTPLimits()
	l.body, l.bodies = time.Minute, 10
	s := startLimited(t, l)
	conns := make([]net.Conn, l.bodies)
	for i := range conns {
		conns[i] = s.slowBody(t)
	}

	var refused *http.Response
	poll.Until(t, time.Minute, "a restock to be refused while the slow bodies fill every slot", func() bool {
		res, v := s.do(t, http.MethodPut, "/stock/SKU-1", `{"on_hand":5,"price":100}`)
		if res.StatusCode == http.StatusServiceUnavailable && v["code"] == "overloaded" {
			refused = res
			return true
		}
		if res.StatusCode != http.StatusOK {
			t.Fatalf("PUT /stock/SKU-1: %d %v, want 200 until the slots are full, then 503 overloaded", res.StatusCode, v)
		}
		return false
	})
	if refused.Header.Get("Retry-After") != "1" || !refused.Close {
		t.Errorf("the refusal: Retry-After %q, Connection: close %v; want 1 and true", refused.Header.Get("Retry-After"), refused.Close)
	}
	if res, _ := s.do(t, http.MethodGet, "/stock/SKU-1", ""); res.StatusCode != http.StatusOK && res.StatusCode != http.StatusNotFound {
		t.Errorf("GET /stock/SKU-1 with the slots full: %d, want it served", res.StatusCode)
	}
	for _, conn := range conns {
		conn.Close() // the slow clients give up
	}
	poll.Until(t, 30*time.Second, "a restock served once the slow bodies are gone", func() bool {
		res, v := s.do(t, http.MethodPut, "/stock/SKU-1", `{"on_hand":6,"price":100}`)
		if res.StatusCode != http.StatusOK && (res.StatusCode != http.StatusServiceUnavailable || v["code"] != "overloaded") {
			t.Fatalf("PUT /stock/SKU-1 after the slow bodies were gone: %d %v, want 503 overloaded, then 200", res.StatusCode, v)
		}
		return res.StatusCode == http.StatusOK
	})
}
