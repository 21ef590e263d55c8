package httpx_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/proof/rawhttp"
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
// the next request. The client that sent "Expect: 100-continue" and then
// the body anyway (as curl does when no 100 comes within a second) was
// answered 431: the rest of its body read as the next request's header.
func TestTheRequestAfterARefusedBodyGetsItsOwnAnswer(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(httpx.Bodies(http.HandlerFunc(echoJSON)))
	defer srv.Close()
	huge := `{"customer_id":"` + strings.Repeat("x", 2<<20) + `"}`
	length := fmt.Sprintf("Content-Length: %d", len(huge))
	next := "POST / HTTP/1.1\r\nHost: shop\r\nContent-Type: text/plain\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
	head := "POST / HTTP/1.1\r\nHost: shop\r\n"
	for _, tc := range []struct {
		name string
		req  rawhttp.Request
	}{
		{"length known", rawhttp.Request{Head: head + "Content-Type: application/json\r\n" + length + "\r\n", Body: huge}},
		{"chunked", rawhttp.Request{Head: head + "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n", Body: rawhttp.Chunked(huge)}},
		{"chunked, wrong type", rawhttp.Request{Head: head + "Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n", Body: rawhttp.Chunked(huge)}},
		{"100-continue, then the body anyway", rawhttp.Request{Head: head + "Content-Type: application/json\r\nExpect: 100-continue\r\n" + length + "\r\n",
			Body: huge, ExpectContinue: true}},
		{"100-continue, wrong type, then the body anyway", rawhttp.Request{Head: head + "Content-Type: text/plain\r\nExpect: 100-continue\r\n" + length + "\r\n",
			Body: huge, ExpectContinue: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for range 5 {
				rawhttp.AfterRefusal(t, srv.Listener.Addr().String(), tc.req, next, http.StatusUnsupportedMediaType,
					http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType)
			}
		})
	}
}
