package httpx_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/shop-ref/shop/internal/httpx"
)

// echoJSON reads the body as the services do and answers 200 or its problem.
func echoJSON(w http.ResponseWriter, r *http.Request) {
	var v map[string]any
	if _, err := httpx.Decode(r, &v); err != nil {
		httpx.WriteProblem(w, r, nil, err)
		return
	}
	httpx.WriteJSON(w, http.StatusOK, v)
}

// An oversized body is always answered with the 413 problem, never with a
// reset connection, whether or not its length is known in advance: the
// server reads and discards what the handler left unread, so the client
// finishes sending and reads the answer.
func TestOversizedBodyIsAlways413(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(httpx.Bodies(http.HandlerFunc(echoJSON)))
	defer srv.Close()

	for _, size := range []int{2 << 20, 20 << 20} {
		body := []byte(`{"customer_id":"` + strings.Repeat("x", size) + `"}`)
		for _, known := range []bool{true, false} {
			t.Run(fmt.Sprintf("%dMB/length known %v", size>>20, known), func(t *testing.T) {
				for i := range 25 {
					// A fresh connection each time: the reset, when it
					// happens, is a race on one connection's close.
					client := &http.Client{Transport: &http.Transport{DisableKeepAlives: i%2 == 0}}
					var rd io.Reader = bytes.NewReader(body)
					if !known {
						rd = io.MultiReader(rd) // hides the length: chunked
					}
					req, _ := http.NewRequest(http.MethodPost, srv.URL, rd)
					req.Header.Set("Content-Type", "application/json")
					res, err := client.Do(req)
					if err != nil {
						t.Fatalf("attempt %d: %v", i+1, err)
					}
					checkTooLarge(t, res)
					client.CloseIdleConnections()
				}
			})
		}
	}
	t.Run("small bodies still work on a reused connection", func(t *testing.T) {
		for range 5 {
			res, err := http.Post(srv.URL, "application/json", strings.NewReader(`{"a":1}`))
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusOK {
				t.Fatalf("status %d, want 200", res.StatusCode)
			}
		}
	})
}

// curl sends Expect: 100-continue for large bodies: the 413 arrives before
// it sends the body; without that header it sends all and still reads it.
func TestOversizedBodyIs413ForCurl(t *testing.T) {
	t.Parallel()
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Skip("curl is not installed") // the Go client test above covers the server
	}
	srv := httptest.NewServer(httpx.Bodies(http.HandlerFunc(echoJSON)))
	defer srv.Close()
	file := t.TempDir() + "/body.json"
	writeFile(t, file, `{"customer_id":"`+strings.Repeat("x", 20<<20)+`"}`)
	for _, expect := range []string{"Expect: 100-continue", "Expect:"} {
		for i := range 10 {
			out, err := exec.Command(curl, "-sS", "-o", "-", "-w", "\n%{http_code}", "-X", "POST",
				"-H", "Content-Type: application/json", "-H", expect,
				"--data-binary", "@"+file, srv.URL).CombinedOutput()
			if err != nil {
				t.Fatalf("%s, attempt %d: curl: %v: %s", expect, i+1, err, out)
			}
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			if code := lines[len(lines)-1]; code != "413" {
				t.Fatalf("%s, attempt %d: status %s, want 413: %s", expect, i+1, code, out)
			}
		}
	}
}

func checkTooLarge(t *testing.T, res *http.Response) {
	t.Helper()
	defer res.Body.Close()
	var p httpx.Problem
	if err := json.NewDecoder(res.Body).Decode(&p); err != nil {
		t.Fatalf("status %d, body unreadable: %v", res.StatusCode, err)
	}
	if res.StatusCode != http.StatusRequestEntityTooLarge || p.Code != "body-too-large" {
		t.Fatalf("got %d %q, want 413 body-too-large", res.StatusCode, p.Code)
	}
}

func writeFile(t *testing.T, name, s string) {
	t.Helper()
	if err := os.WriteFile(name, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}

// The request after a refused body, on the same connection, gets its own
// answer: whatever the server did with the rest of the refused body (read
// it all, or closed the connection saying so), it never reads that rest as
// the next request. Raw TCP, so no client hides a closed connection by
// retrying on a new one. The client that sent "Expect: 100-continue" and
// then the body anyway (as curl does when no 100 comes within a second) was
// answered 431: the rest of its body read as the next request's header.
func TestTheRequestAfterARefusedBodyGetsItsOwnAnswer(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(httpx.Bodies(http.HandlerFunc(echoJSON)))
	defer srv.Close()
	huge := `{"customer_id":"` + strings.Repeat("x", 2<<20) + `"}`
	chunked := fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(huge), huge)
	next := "POST / HTTP/1.1\r\nHost: shop\r\nContent-Type: text/plain\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
	for _, tc := range []struct {
		name, header, body string
		expect             bool // the header asks for 100-continue; the body follows the answer
	}{
		{"length known", "Content-Type: application/json\r\n" + fmt.Sprintf("Content-Length: %d\r\n", len(huge)), huge, false},
		{"chunked", "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n", chunked, false},
		{"chunked, wrong type", "Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n", chunked, false},
		{"100-continue, then the body anyway", "Content-Type: application/json\r\nExpect: 100-continue\r\n" +
			fmt.Sprintf("Content-Length: %d\r\n", len(huge)), huge, true},
		{"100-continue, wrong type, then the body anyway", "Content-Type: text/plain\r\nExpect: 100-continue\r\n" +
			fmt.Sprintf("Content-Length: %d\r\n", len(huge)), huge, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for i := range 5 {
				conn, err := net.Dial("tcp", srv.Listener.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				head := "POST / HTTP/1.1\r\nHost: shop\r\n" + tc.header + "\r\n"
				if tc.expect {
					_, _ = io.WriteString(conn, head)
				} else {
					// Both requests at once, as a pipelining client sends
					// them: the server must tell where the first one ends.
					go func() { _, _ = io.WriteString(conn, head+tc.body+next) }()
				}
				rd := bufio.NewReader(conn)
				first, err := http.ReadResponse(rd, nil)
				if err != nil {
					t.Fatalf("attempt %d: the first answer: %v", i+1, err)
				}
				_, _ = io.Copy(io.Discard, first.Body)
				first.Body.Close()
				if first.StatusCode != http.StatusRequestEntityTooLarge && first.StatusCode != http.StatusUnsupportedMediaType {
					t.Fatalf("attempt %d: first answer %d, want 413 or 415", i+1, first.StatusCode)
				}
				if tc.expect {
					go func() { _, _ = io.WriteString(conn, tc.body+next) }()
				}
				second, err := http.ReadResponse(rd, nil)
				switch {
				case err == nil:
					body, _ := io.ReadAll(second.Body)
					second.Body.Close()
					if second.StatusCode != http.StatusUnsupportedMediaType || second.Header.Get("Content-Type") != "application/problem+json" {
						t.Fatalf("attempt %d: the next request on the connection got %d %q %.100s, want its own 415 problem (first answer said close: %v)",
							i+1, second.StatusCode, second.Header.Get("Content-Type"), body, first.Close)
					}
				case first.Close && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)):
					// The server said "Connection: close" and closed: the
					// client sends the next request on a new connection.
				default:
					t.Fatalf("attempt %d: the next request on the connection: %v (first answer said close: %v)", i+1, err, first.Close)
				}
				conn.Close()
			}
		})
	}
}
