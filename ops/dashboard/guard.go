package dashboard

import (
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
)

// loopback are the names the dashboard always answers to: a browser on the
// machine it runs on reaches it by one of them.
var loopback = []string{"localhost", "127.0.0.1", "::1"}

// contentSecurityPolicy lets the page load its own script, styles and
// requests and nothing else: no inline script (the page has none), no
// other origin, no framing. uPlot styles its elements through the CSSOM
// (element.style), which style-src does not restrict.
const contentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// guard wraps the dashboard's routes with what a page on the operator's
// machine needs against other pages in the same browser:
//
//   - every response forbids framing (clickjacking) and carries the
//     content-security policy and nosniff;
//   - a Host the dashboard was not told to answer to is refused (421)
//     before any route runs. A DNS-rebinding page points a name of its own
//     at this address so that the browser treats the dashboard as its own
//     origin; its requests then carry that name as Host, and are refused.
//     That check is also what keeps /api/state (every customer's recent
//     orders) from other origins: the dashboard sends no CORS headers, so
//     the browser shows its answers to its own origin only, and rebinding
//     is the way round that;
//   - a request that changes something (any method but GET, HEAD and
//     OPTIONS) from another origin is refused (403): a cross-site form or a
//     text/plain fetch is sent without a CORS preflight, so refusing to
//     answer is not enough; it must not run. http.CrossOriginProtection
//     reads Sec-Fetch-Site, else compares Origin with Host; a request with
//     neither comes from no browser (curl, a test) and is served.
func (s *Server) guard(next http.Handler) http.Handler {
	cop := http.NewCrossOriginProtection()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", contentSecurityPolicy)
		h.Set("X-Frame-Options", "DENY")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cross-Origin-Resource-Policy", "same-origin")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		if !slices.Contains(s.hosts, hostName(r.Host)) {
			writeJSON(w, http.StatusMisdirectedRequest, map[string]string{"error": fmt.Sprintf("the dashboard does not answer to host %q: "+
				"it answers to localhost, 127.0.0.1, [::1], the host of DASHBOARD_ADDR and the names in DASHBOARD_HOSTS", r.Host)})
			return
		}
		if err := cop.Check(r); err != nil {
			writeJSON(w, http.StatusForbidden, map[string]string{"error": "cross-origin request refused: the dashboard acts " +
				"only for its own page (" + err.Error() + ")"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// hostName is the host of a Host header or a configured name, without its
// port, brackets, trailing dot or case: "LocalHost.:8080" is "localhost",
// "[::1]:8080" is "::1".
func hostName(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	return strings.TrimSuffix(strings.ToLower(host), ".")
}
