package inventory

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
)

// do sends a request to the service and returns the status, content type and
// body.
func (f *fixture) do(t *testing.T, method, path, contentType, body string) (int, string, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, f.http.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header.Get("Content-Type"), b
}

func (f *fixture) put(t *testing.T, sku, body string) (int, []byte) {
	t.Helper()
	status, _, b := f.do(t, http.MethodPut, "/stock/"+sku, "application/json", body)
	return status, b
}

func TestPutAndGetStock(t *testing.T) {
	t.Parallel()
	f := setup(t)

	status, body := f.put(t, "SKU-1", `{"on_hand":100,"price":1999}`)
	if status != http.StatusOK {
		t.Fatalf("PUT: status %d: %s", status, body)
	}
	want := Stock{SKU: "SKU-1", OnHand: 100, Available: 100, Price: 1999}
	if got := decode[Stock](t, string(body)); got != want {
		t.Fatalf("PUT answered %+v, want %+v", got, want)
	}

	status, ct, body := f.do(t, http.MethodGet, "/stock/SKU-1", "", "")
	if status != http.StatusOK || ct != "application/json" {
		t.Fatalf("GET: status %d, content type %q: %s", status, ct, body)
	}
	if got := decode[Stock](t, string(body)); got != want {
		t.Fatalf("GET answered %+v, want %+v", got, want)
	}

	// Restock: absolute values; supplied follows on_hand, down as well as up.
	if status, body := f.put(t, "SKU-1", `{"on_hand":40,"price":2500}`); status != http.StatusOK {
		t.Fatalf("second PUT: status %d: %s", status, body)
	}
	if got := f.stock(t, "SKU-1"); got.OnHand != 40 || got.Price != 2500 || got.Supplied != 40 {
		t.Fatalf("after restock: %+v, want on_hand 40, price 2500, supplied 40", got)
	}

	evs := f.events(t, "SKU-1")
	if len(evs) != 2 || evs[0].Type != TypeProductUpdated || evs[1].Type != TypeProductUpdated {
		t.Fatalf("outbox: %+v, want two ProductUpdated", evs)
	}
	wantEv := ProductUpdated{SKU: "SKU-1", Price: 2500, OnHand: 40, Available: 40}
	if got := decode[ProductUpdated](t, evs[1].Payload); got != wantEv {
		t.Fatalf("ProductUpdated payload %+v, want %+v", got, wantEv)
	}
	// The payload has exactly the documented fields.
	var fields map[string]any
	_ = json.Unmarshal([]byte(evs[1].Payload), &fields)
	for _, k := range []string{"sku", "price", "on_hand", "reserved", "available"} {
		if _, ok := fields[k]; !ok {
			t.Errorf("ProductUpdated payload lacks %q: %s", k, evs[1].Payload)
		}
	}
	rec := outboxtest.Written(t, f.pool, outboxtest.Want{AggregateID: "SKU-1"})
	if len(rec) == 0 {
		t.Fatal("no event of SKU-1")
	}
	subject, aggType := rec[0].Subject, rec[0].AggregateType
	if subject != "inventory.SKU-1.ProductUpdated" || aggType != "product" {
		t.Fatalf("subject %q, aggregate type %q", subject, aggType)
	}
}

func TestGetStockProblems(t *testing.T) {
	t.Parallel()
	f := setup(t)
	for _, tc := range []struct {
		name, path string
		status     int
		code       string
	}{
		{"unknown sku", "/stock/NOPE", http.StatusNotFound, "sku-not-found"},
		{"bad sku", "/stock/" + strings.Repeat("x", 65), http.StatusUnprocessableEntity, "invalid-request"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, ct, body := f.do(t, http.MethodGet, tc.path, "", "")
			checkProblem(t, status, ct, body, tc.status, tc.code)
		})
	}
}

func TestPutStockRefusesBadInput(t *testing.T) {
	t.Parallel()
	f := setup(t)
	for _, tc := range []struct {
		name, sku, contentType, body string
		status                       int
		code                         string
	}{
		{"bad json", "SKU-1", "application/json", `{"on_hand":`, 400, "malformed-json"},
		{"unknown field", "SKU-1", "application/json", `{"on_hand":1,"price":1,"colour":"red"}`, 400, "malformed-json"},
		{"wrong type", "SKU-1", "application/json", `{"on_hand":"1","price":1}`, 400, "malformed-json"},
		{"fraction", "SKU-1", "application/json", `{"on_hand":1.5,"price":1}`, 400, "malformed-json"},
		{"two values", "SKU-1", "application/json", `{"on_hand":1,"price":1} {}`, 400, "malformed-json"},
		{"wrong content type", "SKU-1", "text/plain", `{"on_hand":1,"price":1}`, 415, "unsupported-media-type"},
		{"no content type", "SKU-1", "", `{"on_hand":1,"price":1}`, 415, "unsupported-media-type"},
		{"body too large", "SKU-1", "application/json",
			`{"on_hand":1,"price":1` + strings.Repeat(" ", httpx.MaxBody) + `}`, 413, "body-too-large"},
		{"bad sku", "SKU.1", "application/json", `{"on_hand":1,"price":1}`, 422, "invalid-request"},
		{"sku too long", strings.Repeat("A", 65), "application/json", `{"on_hand":1,"price":1}`, 422, "invalid-request"},
		{"negative on_hand", "SKU-1", "application/json", `{"on_hand":-1,"price":1}`, 422, "invalid-request"},
		{"huge on_hand", "SKU-1", "application/json", `{"on_hand":1000000001,"price":1}`, 422, "invalid-request"},
		{"negative price", "SKU-1", "application/json", `{"on_hand":1,"price":-1}`, 422, "invalid-request"},
		{"missing on_hand", "SKU-1", "application/json", `{"price":1}`, 422, "invalid-request"},
		{"missing price", "SKU-1", "application/json", `{"on_hand":1}`, 422, "invalid-request"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, ct, body := f.do(t, http.MethodPut, "/stock/"+tc.sku, tc.contentType, tc.body)
			checkProblem(t, status, ct, body, tc.status, tc.code)
		})
	}
	// A refused request writes nothing: no stock, no event intent.
	if n := f.count(t, `SELECT count(*) FROM stock`); n != 0 {
		t.Errorf("%d stock rows after refused requests", n)
	}
	if n := len(outboxtest.Written(t, f.pool, outboxtest.Want{})); n != 0 {
		t.Errorf("%d outbox rows after refused requests", n)
	}
}

func TestPutStockBelowReserved(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.seed(t, "SKU-1", 10, 100)
	if err := f.apply(t, message(t, "o-1", 1, TypeOrderCreated, orderCreated("o-1", Item{"SKU-1", 6}))); err != nil {
		t.Fatal(err)
	}
	before := len(outboxtest.Written(t, f.pool, outboxtest.Want{}))

	status, ct, body := f.do(t, http.MethodPut, "/stock/SKU-1", "application/json", `{"on_hand":5,"price":100}`)
	checkProblem(t, status, ct, body, http.StatusConflict, "below-reserved")
	if got := f.stock(t, "SKU-1"); got.OnHand != 10 || got.Reserved != 6 || got.Supplied != 10 {
		t.Fatalf("a refused restock changed stock: %+v", got)
	}
	if n := len(outboxtest.Written(t, f.pool, outboxtest.Want{})); n != before {
		t.Fatalf("a refused restock wrote %d outbox rows", n-before)
	}

	// Down to exactly what is reserved is allowed.
	status, body = f.put(t, "SKU-1", `{"on_hand":6,"price":100}`)
	if status != http.StatusOK {
		t.Fatalf("PUT on_hand = reserved: status %d: %s", status, body)
	}
	if got := decode[Stock](t, string(body)); got.Available != 0 || got.Reserved != 6 {
		t.Fatalf("PUT answered %+v", got)
	}
}

func checkProblem(t *testing.T, status int, ct string, body []byte, wantStatus int, wantCode string) {
	t.Helper()
	if status != wantStatus {
		t.Fatalf("status %d, want %d: %s", status, wantStatus, body)
	}
	if ct != "application/problem+json" {
		t.Fatalf("content type %q, want application/problem+json", ct)
	}
	p := decode[httpx.Problem](t, string(body))
	if p.Code != wantCode || p.Status != wantStatus {
		t.Fatalf("problem %+v, want code %q and status %d", p, wantCode, wantStatus)
	}
}
