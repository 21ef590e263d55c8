package order

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/shop-ref/shop/internal/httpx"
)

// Limits of a new order, from the contract.
const (
	maxKeyLen      = 255
	maxCustomerLen = 64
	maxLines       = 100
	maxQuantity    = 1000
)

// createRequest is the body of POST /orders.
type createRequest struct {
	CustomerID string `json:"customer_id"`
	Items      []struct {
		SKU      string `json:"sku"`
		Quantity int    `json:"quantity"`
	} `json:"items"`
}

// checkKey accepts 1..255 printable ASCII characters: keys are compared
// byte for byte, and anything else is more likely a client bug than a key.
func checkKey(key string) error {
	if key == "" || len(key) > maxKeyLen {
		return httpx.NewProblem(http.StatusBadRequest, "idempotency-key",
			fmt.Sprintf("the Idempotency-Key header is required: 1 to %d printable ASCII characters", maxKeyLen))
	}
	for i := range len(key) {
		if key[i] < 0x20 || key[i] > 0x7e {
			return httpx.NewProblem(http.StatusBadRequest, "idempotency-key",
				"the Idempotency-Key header may hold printable ASCII characters only")
		}
	}
	return nil
}

// validate checks what needs no database. A SKU listed twice is refused
// (422) rather than merged: the client most likely made a mistake, and
// merging would make the stored lines differ from the request.
func (req *createRequest) validate() error {
	// Characters, not bytes, as the contract's maxLength counts them; and
	// printable only (NUL, which Postgres text cannot hold, was a 500;
	// found by FuzzOrderRequest).
	if err := httpx.Text("customer_id", req.CustomerID, maxCustomerLen); err != nil {
		return err
	}
	if len(req.Items) == 0 || len(req.Items) > maxLines {
		return httpx.Invalid("an order needs 1 to %d lines, not %d", maxLines, len(req.Items))
	}
	seen := map[string]bool{}
	for i, it := range req.Items {
		switch {
		case !httpx.ValidSKU(it.SKU):
			return httpx.Invalid("items[%d].sku %q must match [A-Za-z0-9_-]{1,64}", i, it.SKU)
		case it.Quantity < 1 || it.Quantity > maxQuantity:
			return httpx.Invalid("items[%d].quantity must be 1 to %d, not %d", i, maxQuantity, it.Quantity)
		case seen[it.SKU]:
			return httpx.Invalid("items[%d]: sku %q is listed twice; put it on one line", i, it.SKU)
		}
		seen[it.SKU] = true
	}
	return nil
}

// hash is the request's fingerprint for the idempotency check: SHA-256 of
// the decoded request encoded again as JSON, so whitespace, field order and
// escapes in the raw body do not matter, but every value does.
func (req *createRequest) hash() []byte {
	b, _ := json.Marshal(req) // a struct of strings and ints cannot fail
	h := sha256.Sum256(b)
	return h[:]
}

// skus lists the request's SKUs, in request order.
func (req *createRequest) skus() []string {
	skus := make([]string, len(req.Items))
	for i, it := range req.Items {
		skus[i] = it.SKU
	}
	return skus
}
