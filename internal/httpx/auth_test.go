package httpx_test

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/shop-ref/shop/internal/httpx"
)

func TestRequireBearer(t *testing.T) {
	t.Parallel()
	served := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { served++; w.WriteHeader(http.StatusNoContent) })
	call := func(h http.Handler, auth string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPut, "/stock/SKU-1", strings.NewReader(`{"on_hand":1,"price":1}`))
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}

	t.Run("token set", func(t *testing.T) {
		h := httpx.RequireBearer("s3cret-token", slog.New(slog.DiscardHandler))(next)
		for _, tc := range []struct{ name, auth, challenge string }{
			{"no header", "", `Bearer realm="shop"`},
			{"another scheme", "Basic s3cret-token", `Bearer realm="shop"`},
			{"no token", "Bearer ", `Bearer realm="shop"`},
			{"wrong token", "Bearer s3cret-tokex", `Bearer realm="shop", error="invalid_token"`},
			{"a prefix of it", "Bearer s3cret", `Bearer realm="shop", error="invalid_token"`},
			{"longer", "Bearer s3cret-token-and-more", `Bearer realm="shop", error="invalid_token"`},
		} {
			before := served
			rec := call(h, tc.auth)
			var p httpx.Problem
			if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil || rec.Code != http.StatusUnauthorized ||
				rec.Header().Get("Content-Type") != "application/problem+json" || p.Status != 401 || p.Code != "unauthorized" {
				t.Errorf("%s: %d %q %s", tc.name, rec.Code, rec.Header().Get("Content-Type"), rec.Body)
			}
			if got := rec.Header().Get("WWW-Authenticate"); got != tc.challenge {
				t.Errorf("%s: WWW-Authenticate %q, want %q", tc.name, got, tc.challenge)
			}
			if strings.Contains(rec.Body.String(), "s3cret") {
				t.Errorf("%s: the answer shows the token: %s", tc.name, rec.Body)
			}
			if served != before {
				t.Errorf("%s: the handler ran", tc.name)
			}
		}
		for _, auth := range []string{"Bearer s3cret-token", "bearer s3cret-token"} {
			before := served
			if rec := call(h, auth); rec.Code != http.StatusNoContent || served != before+1 {
				t.Errorf("%q: %d, handler ran %d times", auth, rec.Code, served-before)
			}
		}
	})

	t.Run("no token set: open", func(t *testing.T) {
		h := httpx.RequireBearer("", slog.New(slog.DiscardHandler))(next)
		for _, auth := range []string{"", "Bearer anything"} {
			before := served
			if rec := call(h, auth); rec.Code != http.StatusNoContent || served != before+1 {
				t.Errorf("%q: %d, handler ran %d times", auth, rec.Code, served-before)
			}
		}
	})
}
