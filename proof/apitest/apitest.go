// Package apitest checks the shop's real HTTP responses against
// api/openapi.yaml: status, headers and body of every response a test's
// client receives, validated with kin-openapi against the operation the
// request matched. Wrap a client's transport with Checker.Transport; a
// response the document does not describe fails the request (client.Do
// returns the mismatch as its error) and is kept for Checker.Mismatches, so
// that a caller that ignores errors (a polling loop) cannot hide it.
//
// The checker also counts the statuses it saw, so that a suite can assert
// that it really exercised the responses it claims to validate.
package apitest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"runtime"
	"sync"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"
)

// SpecFile is the path of api/openapi.yaml, found from this source file so
// that any package's tests can load it.
func SpecFile() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "api", "openapi.yaml")
}

// Checker validates responses against the document. It is safe for
// concurrent use.
type Checker struct {
	router routers.Router

	mu         sync.Mutex
	statuses   map[int]int
	unrouted   map[string]int // "GET /nowhere" → count: requests no documented path matched
	mismatches []string
}

// New loads and validates api/openapi.yaml. The document's servers are
// dropped: tests run the services on ports of their own, and a path names
// one service anyway.
func New() (*Checker, error) {
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromFile(SpecFile())
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", SpecFile(), err)
	}
	if err := doc.Validate(loader.Context); err != nil {
		return nil, fmt.Errorf("%s is not a valid OpenAPI document: %w", SpecFile(), err)
	}
	doc.Servers = nil
	for _, item := range doc.Paths.Map() {
		item.Servers = nil
	}
	router, err := gorillamux.NewRouter(doc)
	if err != nil {
		return nil, fmt.Errorf("route %s: %w", SpecFile(), err)
	}
	return &Checker{router: router, statuses: map[int]int{}, unrouted: map[string]int{}}, nil
}

// Check validates one response to req: its status must be documented for
// the operation, its headers and body must match the response's schemas.
// A HEAD response is checked against the HEAD operation's headers and must
// have no body. A request to a path the document does not have is counted
// (Unrouted), not checked: it is the router's plain 404 or 405.
func (c *Checker) Check(req *http.Request, status int, header http.Header, body []byte) error {
	c.mu.Lock()
	c.statuses[status]++
	c.mu.Unlock()

	route, params, err := c.router.FindRoute(req)
	if err != nil {
		if errors.Is(err, routers.ErrPathNotFound) || errors.Is(err, routers.ErrMethodNotAllowed) {
			c.mu.Lock()
			c.unrouted[req.Method+" "+req.URL.Path]++
			c.mu.Unlock()
			return nil
		}
		return c.mismatch(req, status, fmt.Errorf("find route: %w", err))
	}
	validated := req
	if req.Method == http.MethodHead {
		if len(body) > 0 {
			return c.mismatch(req, status, fmt.Errorf("a HEAD response has a body of %d bytes", len(body)))
		}
		// kin-openapi skips HEAD responses altogether; validated as any
		// other method, the HEAD operation's (bodiless) responses still
		// check the status and the headers.
		validated = req.Clone(req.Context())
		validated.Method = http.MethodGet
	}
	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{Request: validated, PathParams: params, Route: route},
		Status:                 status,
		Header:                 header,
		Options:                &openapi3filter.Options{IncludeResponseStatus: true, MultiError: true},
	}
	in.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(context.Background(), in); err != nil {
		return c.mismatch(req, status, err)
	}
	return nil
}

func (c *Checker) mismatch(req *http.Request, status int, err error) error {
	err = fmt.Errorf("api/openapi.yaml does not describe the response %d to %s %s: %w", status, req.Method, req.URL.Path, err)
	c.mu.Lock()
	c.mismatches = append(c.mismatches, err.Error())
	c.mu.Unlock()
	return err
}

// Statuses returns how many responses of each status were checked.
func (c *Checker) Statuses() map[int]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[int]int, len(c.statuses))
	for k, v := range c.statuses {
		out[k] = v
	}
	return out
}

// Unrouted returns the requests no documented operation matched.
func (c *Checker) Unrouted() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.unrouted))
	for k, v := range c.unrouted {
		out[k] = v
	}
	return out
}

// Mismatches returns every mismatch found so far.
func (c *Checker) Mismatches() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.mismatches...)
}

// Missing returns the statuses of want that no checked response had.
func (c *Checker) Missing(want ...int) []int {
	seen := c.Statuses()
	var missing []int
	for _, s := range want {
		if seen[s] == 0 {
			missing = append(missing, s)
		}
	}
	return missing
}

// Transport returns next (http.DefaultTransport if nil) wrapped so that
// every response is read whole, checked, and handed on with its body
// intact; a mismatch is returned as the round trip's error.
func (c *Checker) Transport(next http.RoundTripper) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return &transport{c: c, next: next}
}

type transport struct {
	c    *Checker
	next http.RoundTripper
}

func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	res, err := t.next.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(res.Body)
	res.Body.Close()
	if err != nil {
		return nil, err
	}
	res.Body = io.NopCloser(bytes.NewReader(body))
	if err := t.c.Check(req, res.StatusCode, res.Header, body); err != nil {
		return nil, err
	}
	return res, nil
}
