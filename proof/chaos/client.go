package chaos

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"
)

// The harness as a client of the shop's public HTTP API.

func (h *harness) urls(service string) []string {
	var out []string
	for _, s := range h.slots {
		if s.service == service {
			out = append(out, "http://"+s.addr)
		}
	}
	return out
}

// do sends one request and reads the answer.
func (h *harness) do(ctx context.Context, method, url, key string, header map[string]string, body []byte) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := h.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	return res.StatusCode, b, err
}

// restock stocks the SKUs plentifully and waits until the order service
// knows them (a probe order gets through; it is cancelled).
func (h *harness) restock(ctx context.Context, skus []string) {
	inv := h.urls("inventory")[0]
	for _, sku := range skus {
		st, b, err := h.do(ctx, http.MethodPut, inv+"/stock/"+sku, "", map[string]string{"Authorization": "Bearer " + operatorToken},
			[]byte(`{"on_hand":1000000,"price":250}`))
		if err != nil || st != http.StatusOK {
			h.fatalf("restock %s: %d %s %v", sku, st, b, err)
		}
		for _, ou := range h.urls("order") {
			deadline := time.Now().Add(30 * time.Second)
			for {
				body := fmt.Sprintf(`{"customer_id":"probe","items":[{"sku":%q,"quantity":1}]}`, sku)
				st, b, err := h.do(ctx, http.MethodPost, ou+"/orders", "probe-"+sku+"-"+randHex(), nil, []byte(body))
				if err == nil && st == http.StatusCreated {
					var o struct {
						OrderID string `json:"order_id"`
					}
					_ = json.Unmarshal(b, &o)
					for range 100 {
						st, _, err := h.do(ctx, http.MethodPost, ou+"/orders/"+o.OrderID+"/cancel", "", nil, nil)
						if err == nil && (st == http.StatusAccepted || st == http.StatusConflict) {
							break
						}
						time.Sleep(100 * time.Millisecond)
					}
					break
				}
				if time.Now().After(deadline) {
					h.fatalf("the order service never learned %s: %d %s %v", sku, st, b, err)
				}
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
}

// webhook sends a provider callback signed as the contract says.
func (h *harness) webhook(ctx context.Context, base, orderID, providerID string, amount int64) (int, error) {
	body, _ := json.Marshal(map[string]any{"order_id": orderID, "provider_payment_id": providerID, "status": "succeeded", "amount": amount})
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	mac := hmac.New(sha256.New, []byte(webhookSecret))
	mac.Write([]byte(ts + "." + string(body)))
	st, _, err := h.do(ctx, http.MethodPost, base+"/webhooks/payment", "",
		map[string]string{"Payment-Signature": "t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))}, body)
	return st, err
}

func randHex() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
