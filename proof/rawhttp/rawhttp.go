// Package rawhttp is a test helper: one HTTP/1.1 connection driven by hand,
// so that what a server does with the rest of a refused request body shows,
// and no client hides it by retrying on a fresh connection.
package rawhttp

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"syscall"
	"testing"
)

// Request is a request written by hand: its head (request line and
// headers, without the blank line that ends them) and its body, as bytes on
// the wire (chunked already, if its header says so).
type Request struct {
	Head, Body string
	// ExpectContinue: the head asks for "100 Continue"; the body is sent
	// only after the answer has arrived, as a client does that stops
	// waiting for the 100 (curl, after a second).
	ExpectContinue bool
}

// AfterRefusal sends first and then next on one connection to addr, and
// checks that the server answers first with one of refusals and next with
// its own answer, wantNext, as problem+json; or that the first answer said
// "Connection: close" and the server closed the connection. Without
// ExpectContinue, both requests are written at once, as a pipelining client
// does: the server must tell where the first one ends.
func AfterRefusal(t *testing.T, addr string, first Request, next string, wantNext int, refusals ...int) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	head := first.Head + "\r\n"
	if first.ExpectContinue {
		_, _ = io.WriteString(conn, head)
	} else {
		go func() { _, _ = io.WriteString(conn, head+first.Body+next) }()
	}
	rd := bufio.NewReader(conn)
	res, err := http.ReadResponse(rd, nil)
	if err != nil {
		t.Fatalf("the first answer: %v", err)
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	if !slices.Contains(refusals, res.StatusCode) {
		t.Fatalf("the first answer is %d, want one of %v", res.StatusCode, refusals)
	}
	if first.ExpectContinue {
		go func() { _, _ = io.WriteString(conn, first.Body+next) }()
	}
	second, err := http.ReadResponse(rd, nil)
	switch {
	case err == nil:
		body, _ := io.ReadAll(second.Body)
		second.Body.Close()
		if second.StatusCode != wantNext || second.Header.Get("Content-Type") != "application/problem+json" {
			t.Fatalf("the next request on the connection got %d %q %.100s, want its own %d problem (the first answer said close: %v)",
				second.StatusCode, second.Header.Get("Content-Type"), body, wantNext, res.Close)
		}
	case res.Close && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)):
		// The server said "Connection: close" and closed: a client sends
		// its next request on a new connection.
	default:
		t.Fatalf("the next request on the connection: %v (the first answer said close: %v)", err, res.Close)
	}
}

// Chunked is body in one chunk and the last, as Transfer-Encoding: chunked
// sends it.
func Chunked(body string) string { return fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(body), body) }
