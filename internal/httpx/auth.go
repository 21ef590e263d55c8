package httpx

import (
	"crypto/sha256"
	"crypto/subtle"
	"log/slog"
	"net/http"
	"strings"
)

// RequireBearer is middleware for an operator's endpoint: with token set,
// it serves a request only if it carries "Authorization: Bearer <token>",
// and answers any other 401 with a problem+json body and a
// WWW-Authenticate challenge (RFC 6750), before the handler reads the body
// or writes anything. With token empty it lets every request through: the
// deployment has chosen no credential (the demo; the process warns).
//
// The comparison is of SHA-256 digests in constant time, so neither the
// token's bytes nor its length can be learned from response times. The
// token is never logged; a refusal is, with the client's address.
func RequireBearer(token string, log *slog.Logger) func(http.Handler) http.Handler {
	want := sha256.Sum256([]byte(token))
	return func(next http.Handler) http.Handler {
		if token == "" {
			return next
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			scheme, got, _ := strings.Cut(r.Header.Get("Authorization"), " ")
			if !strings.EqualFold(scheme, "Bearer") || got == "" {
				log.Warn("operator request without a bearer token", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr)
				w.Header().Set("WWW-Authenticate", `Bearer realm="shop"`)
				WriteProblem(w, r, log, NewProblem(http.StatusUnauthorized, "unauthorized",
					"this operator endpoint needs the header Authorization: Bearer <OPERATOR_TOKEN>"))
				return
			}
			if sum := sha256.Sum256([]byte(strings.TrimSpace(got))); subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
				log.Warn("operator request with a wrong bearer token", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr)
				w.Header().Set("WWW-Authenticate", `Bearer realm="shop", error="invalid_token"`)
				WriteProblem(w, r, log, NewProblem(http.StatusUnauthorized, "unauthorized",
					"the bearer token is not this deployment's OPERATOR_TOKEN"))
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}
