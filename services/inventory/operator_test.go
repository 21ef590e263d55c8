package inventory

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/shop-ref/shop/internal/registry"
)

// With an operator token, PUT /stock/{sku} is the operator's only: a
// request without it, or with another, is 401 and writes nothing; GET stays
// open. Without one (setup's service) it is open, as every other test here
// shows.
func TestRestockNeedsTheOperatorToken(t *testing.T) {
	t.Parallel()
	f := setup(t)
	svc, err := New(registry.Deps{Pool: f.pool, JetStream: f.js}, Config{OperatorToken: "op-token"})
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	svc.Routes(r)
	srv := httptest.NewServer(r)
	defer srv.Close()
	put := func(auth string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPut, srv.URL+"/stock/SKU-OP", strings.NewReader(`{"on_hand":7,"price":100}`))
		req.Header.Set("Content-Type", "application/json")
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res
	}
	rows := func() int {
		t.Helper()
		var n int
		if err := f.pool.QueryRow(context.Background(),
			`SELECT (SELECT count(*) FROM stock) + (SELECT count(*) FROM outbox)`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, auth := range []string{"", "Bearer wrong", "op-token"} {
		if res := put(auth); res.StatusCode != http.StatusUnauthorized || res.Header.Get("WWW-Authenticate") == "" {
			t.Errorf("Authorization %q: %s, WWW-Authenticate %q; want 401 with a challenge", auth, res.Status, res.Header.Get("WWW-Authenticate"))
		}
	}
	if n := rows(); n != 0 {
		t.Fatalf("refused restocks wrote %d rows", n)
	}
	if res := put("Bearer op-token"); res.StatusCode != http.StatusOK {
		t.Fatalf("with the token: %s", res.Status)
	}
	if n := rows(); n != 2 {
		t.Fatalf("the restock wrote %d rows, want its stock row and its ProductUpdated", n)
	}
	res, err := http.Get(srv.URL + "/stock/SKU-OP")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET without a token: %s, want 200: reading stays open", res.Status)
	}
}
