package app

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/proof/apitest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/services"
)

// With its database unreachable, every service answers its writes (and
// reads) with the documented 503: dependency-unavailable, Retry-After, a
// problem body that matches api/openapi.yaml; and /readyz is 503 with
// Retry-After too.
func TestDatabaseOutageIs503(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	nc, js := ns.Connect(t)
	const secret = "outage-secret"
	cfg, err := LoadConfig(func(k string) string {
		return map[string]string{"PAYMENT_FAKE_PROVIDER": "true", "PAYMENT_WEBHOOK_SECRET": secret}[k]
	})
	if err != nil {
		t.Fatal(err)
	}
	checker, err := apitest.New()
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: checker.Transport(nil)}
	webhook, _ := json.Marshal(map[string]any{"order_id": uuid.NewString(), "provider_payment_id": "p-1", "status": "succeeded", "amount": 100})
	ts := fmt.Sprint(time.Now().Unix())
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(ts + "." + string(webhook)))
	type request struct {
		method, path string
		header       map[string]string
		body         []byte
	}
	readyz := request{http.MethodGet, "/readyz", nil, nil}
	requests := map[string][]request{
		"order": {
			{http.MethodPost, "/orders", map[string]string{"Idempotency-Key": "k-1"}, []byte(`{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`)},
			{http.MethodGet, "/orders/" + uuid.NewString(), nil, nil},
			{http.MethodPost, "/orders/" + uuid.NewString() + "/cancel", nil, nil},
		},
		"inventory": {
			{http.MethodPut, "/stock/SKU-1", nil, []byte(`{"on_hand":10,"price":100}`)},
			{http.MethodGet, "/stock/SKU-1", nil, nil},
		},
		"payment": {
			{http.MethodPost, "/webhooks/payment", map[string]string{"Payment-Signature": "t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))}, webhook},
			{http.MethodPost, "/payments/" + uuid.NewString() + "/simulate", nil, []byte(`{"outcome":"succeeded"}`)},
			{http.MethodGet, "/payments/" + uuid.NewString(), nil, nil},
		},
		"fulfillment": {
			{http.MethodGet, "/shipments/" + uuid.NewString(), nil, nil},
		},
	}
	for _, name := range services.All.Names() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// Nothing listens on port 1: every query fails to connect.
			pool, err := database.NewPool(context.Background(), "postgres://postgres@127.0.0.1:1/shop?connect_timeout=2", name, 2)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			svc, err := New(name, cfg, nc, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			_, _, handler, err := svc.assemble(pool, js)
			if err != nil {
				t.Fatal(err)
			}
			hs := httptest.NewServer(handler)
			t.Cleanup(hs.Close)
			for _, r := range append(requests[name], readyz) {
				req, _ := http.NewRequest(r.method, hs.URL+r.path, bytes.NewReader(r.body))
				if r.body != nil {
					req.Header.Set("Content-Type", "application/json")
				}
				for k, v := range r.header {
					req.Header.Set(k, v)
				}
				res, err := client.Do(req) // a response api/openapi.yaml does not describe is an error
				if err != nil {
					t.Errorf("%s %s: %v", r.method, r.path, err)
					continue
				}
				var p struct{ Code string }
				_ = json.NewDecoder(res.Body).Decode(&p)
				res.Body.Close()
				want := "dependency-unavailable"
				if r.path == readyz.path {
					want = "" // the readiness report, not a problem
				}
				if res.StatusCode != http.StatusServiceUnavailable || p.Code != want || res.Header.Get("Retry-After") != "1" {
					t.Errorf("%s %s: %d %q Retry-After %q, want 503 %q with Retry-After: 1", r.method, r.path, res.StatusCode, p.Code, res.Header.Get("Retry-After"), want)
				}
			}
		})
	}
}
