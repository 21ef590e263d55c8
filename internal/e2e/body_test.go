package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"

	"github.com/shop-ref/shop/internal/httpx"
)

// Every endpoint that takes a body answers an oversized one with the 413
// problem, read by the client, never with a reset connection; and writes
// nothing. Many times, on fresh connections, with the length known in
// advance and not (chunked), because the reset was a race.
func TestOversizedBodiesAreAlways413(t *testing.T) {
	endpoints := []struct{ method, url, contentType string }{
		{http.MethodPost, shop.order + "/orders", "application/json"},
		{http.MethodPut, shop.inventory + "/stock/SKU-HUGE", "application/json"},
		{http.MethodPost, shop.payment + "/webhooks/payment", "application/json"},
		// A declared length over the limit is refused with 413 before
		// anything else is looked at; a chunked body of the wrong type is
		// refused with 415 before a byte is read, and the rest is still
		// read and discarded.
		{http.MethodPost, shop.order + "/orders", "text/plain"},
	}
	for _, size := range []int{2 << 20, 20 << 20} {
		body := []byte(`{"customer_id":"` + strings.Repeat("x", size) + `"}`)
		for _, ep := range endpoints {
			for _, known := range []bool{true, false} {
				t.Run(fmt.Sprintf("%s %s %s %dMB length known %v", ep.method, ep.url, ep.contentType, size>>20, known), func(t *testing.T) {
					for i := range 8 {
						client := &http.Client{Transport: shop.api.Transport(&http.Transport{DisableKeepAlives: i%2 == 0})}
						var rd io.Reader = bytes.NewReader(body)
						if !known {
							rd = io.MultiReader(rd)
						}
						req, _ := http.NewRequest(ep.method, ep.url, rd)
						req.Header.Set("Content-Type", ep.contentType)
						req.Header.Set("Idempotency-Key", "huge-"+randHex())
						req.Header.Set("Authorization", "Bearer "+operatorToken) // PUT /stock is an operator's
						res, err := client.Do(req)
						if err != nil {
							t.Fatalf("attempt %d: %v", i+1, err)
						}
						var p httpx.Problem
						err = json.NewDecoder(res.Body).Decode(&p)
						res.Body.Close()
						client.CloseIdleConnections()
						want := http.StatusRequestEntityTooLarge
						if ep.contentType != "application/json" && !known {
							want = http.StatusUnsupportedMediaType
						}
						if err != nil || res.StatusCode != want {
							t.Fatalf("attempt %d: status %d (problem %q, %v), want %d", i+1, res.StatusCode, p.Code, err, want)
						}
					}
				})
			}
		}
	}
	var keys int
	if err := shop.pools.Order.QueryRow(t.Context(), `SELECT count(*) FROM idempotency_keys WHERE key LIKE 'huge-%'`).Scan(&keys); err != nil {
		t.Fatal(err)
	}
	if keys != 0 {
		t.Errorf("refused requests stored %d idempotency keys", keys)
	}
}

// The request after a refused body, on the same kept-alive connection, gets
// its own answer from the order service: an order with the wrong content
// type its 415 problem, never a 431 made of the refused body's rest. Raw
// TCP, so that no client retries on a fresh connection behind the test's
// back; the 100-continue case is a client that sends the body after the 413
// anyway, as curl does when no 100 comes.
func TestTheRequestAfterA413GetsItsOwnAnswer(t *testing.T) {
	addr := strings.TrimPrefix(shop.order, "http://")
	huge := `{"customer_id":"` + strings.Repeat("x", 2<<20) + `"}`
	next := "POST /orders HTTP/1.1\r\nHost: shop\r\nIdempotency-Key: after-413-" + randHex() +
		"\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}"
	head := "POST /orders HTTP/1.1\r\nHost: shop\r\nContent-Type: application/json\r\nIdempotency-Key: huge-" + randHex() + "\r\n"
	for _, tc := range []struct {
		name, header, body string
		expect             bool
	}{
		{"length known", fmt.Sprintf("Content-Length: %d\r\n", len(huge)), huge, false},
		{"chunked", "Transfer-Encoding: chunked\r\n", fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(huge), huge), false},
		{"100-continue, then the body anyway", fmt.Sprintf("Expect: 100-continue\r\nContent-Length: %d\r\n", len(huge)), huge, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			first := head + tc.header + "\r\n"
			if tc.expect {
				_, _ = io.WriteString(conn, first)
			} else {
				go func() { _, _ = io.WriteString(conn, first+tc.body+next) }()
			}
			rd := bufio.NewReader(conn)
			res, err := http.ReadResponse(rd, nil)
			if err != nil {
				t.Fatalf("the 413: %v", err)
			}
			_, _ = io.Copy(io.Discard, res.Body)
			if res.StatusCode != http.StatusRequestEntityTooLarge {
				t.Fatalf("first answer %d, want 413", res.StatusCode)
			}
			if tc.expect {
				go func() { _, _ = io.WriteString(conn, tc.body+next) }()
			}
			second, err := http.ReadResponse(rd, nil)
			switch {
			case err == nil:
				body, _ := io.ReadAll(second.Body)
				var p httpx.Problem
				if second.StatusCode != http.StatusUnsupportedMediaType || json.Unmarshal(body, &p) != nil || p.Code != "unsupported-media-type" {
					t.Fatalf("the next request on the connection got %d %.100s, want its own 415 problem", second.StatusCode, body)
				}
			case res.Close && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)):
				// Answered with "Connection: close", and closed: a client
				// sends its next request on a new connection.
			default:
				t.Fatalf("the next request on the connection: %v (the 413 said close: %v)", err, res.Close)
			}
		})
	}
}
