package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/proof/rawhttp"
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
// type its 415 problem, never a 431 made of the refused body's rest. The
// 100-continue case is a client that sends the body after the 413 anyway,
// as curl does when no 100 comes.
func TestTheRequestAfterA413GetsItsOwnAnswer(t *testing.T) {
	huge := `{"customer_id":"` + strings.Repeat("x", 2<<20) + `"}`
	next := "POST /orders HTTP/1.1\r\nHost: shop\r\nIdempotency-Key: after-413-" + randHex() +
		"\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}"
	head := "POST /orders HTTP/1.1\r\nHost: shop\r\nContent-Type: application/json\r\nIdempotency-Key: huge-" + randHex() + "\r\n"
	length := fmt.Sprintf("Content-Length: %d\r\n", len(huge))
	for _, tc := range []struct {
		name string
		req  rawhttp.Request
	}{
		{"length known", rawhttp.Request{Head: head + length, Body: huge}},
		{"chunked", rawhttp.Request{Head: head + "Transfer-Encoding: chunked\r\n", Body: rawhttp.Chunked(huge)}},
		{"100-continue, then the body anyway", rawhttp.Request{Head: head + "Expect: 100-continue\r\n" + length, Body: huge, ExpectContinue: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rawhttp.AfterRefusal(t, strings.TrimPrefix(shop.order, "http://"), tc.req, next,
				http.StatusUnsupportedMediaType, http.StatusRequestEntityTooLarge)
		})
	}
}
