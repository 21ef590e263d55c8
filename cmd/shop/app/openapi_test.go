package app

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/apitest"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services"
)

// openAPIFile is api/openapi.yaml, seen from this package's directory. It is
// JSON-compatible YAML (JSON is valid YAML 1.2), so that it can be read with
// encoding/json: the module has no YAML library and should not need one.
const openAPIFile = "../../../api/openapi.yaml"

// xServiceAll marks a path item that every service serves (/healthz, …).
const xServiceAll = "all"

// openAPIMethods are the operation keys of an OpenAPI path item.
var openAPIMethods = []string{"get", "put", "post", "delete", "options", "head", "patch", "trace"}

// openAPIDoc is api/openapi.yaml: the typed fields the checks need, and the
// whole document as generic JSON, for resolving $refs.
type openAPIDoc struct {
	raw     any
	servers map[string]string // x-service → server url
	// ops is every documented operation: "GET /orders/{id}" → its service.
	ops map[string]string
}

func loadOpenAPI(t *testing.T) *openAPIDoc {
	t.Helper()
	b, err := os.ReadFile(openAPIFile)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		OpenAPI string `json:"openapi"`
		Servers []struct {
			URL     string `json:"url"`
			Service string `json:"x-service"`
		} `json:"servers"`
		Paths map[string]map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatalf("api/openapi.yaml must stay JSON-compatible YAML (plain JSON) so that this test can read it with encoding/json: %v", err)
	}
	d := &openAPIDoc{servers: map[string]string{}, ops: map[string]string{}}
	if err := json.Unmarshal(b, &d.raw); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(doc.OpenAPI, "3.1.") {
		t.Errorf("api/openapi.yaml: openapi is %q, want 3.1.x", doc.OpenAPI)
	}
	for _, s := range doc.Servers {
		d.servers[s.Service] = s.URL
	}
	for path, item := range doc.Paths {
		var service string
		if err := json.Unmarshal(item["x-service"], &service); err != nil || service == "" {
			t.Errorf("api/openapi.yaml: path %s has no x-service naming its owning service (or %q)", path, xServiceAll)
			continue
		}
		if service != xServiceAll && !slices.Contains(services.Deployed().Names(), service) {
			t.Errorf("api/openapi.yaml: path %s has x-service %q, want one of %v or %q", path, service, services.Deployed().Names(), xServiceAll)
		}
		for key := range item {
			if slices.Contains(openAPIMethods, key) {
				d.ops[strings.ToUpper(key)+" "+path] = service
			}
		}
	}
	return d
}

// TestOpenAPI checks api/openapi.yaml against the routers: every route a
// service's router serves is documented for that service (or for all), and
// every operation documented for a service is served by its router; each
// GET and HEAD route's real response is validated against the document.
// (proof/e2e validates every response of the running shop, each status
// it documents included.)
func TestOpenAPI(t *testing.T) {
	t.Parallel()
	doc := loadOpenAPI(t)

	t.Run("document is consistent", func(t *testing.T) {
		t.Parallel()
		for _, name := range services.Deployed().Names() {
			if doc.servers[name] == "" {
				t.Errorf("api/openapi.yaml: no servers entry with x-service %q", name)
			}
		}
		checkRefs(t, doc.raw, doc.raw, "#")
		checkProblemCodes(t, doc.raw)
		paths := doc.raw.(map[string]any)["paths"].(map[string]any)
		for path, v := range paths {
			item := v.(map[string]any)
			service, _ := item["x-service"].(string)
			wantTag := service
			if service == xServiceAll {
				wantTag = "common"
			} else if !slices.ContainsFunc(asSlice(item["servers"]), func(s any) bool {
				url, _ := asMap(s)["url"].(string)
				return url == doc.servers[service]
			}) {
				t.Errorf("api/openapi.yaml: path %s (x-service %s) does not list the %s server %q in its servers", path, service, service, doc.servers[service])
			}
			for _, m := range openAPIMethods {
				op := asMap(item[m])
				if op == nil {
					continue
				}
				where := strings.ToUpper(m) + " " + path
				if !slices.Contains(asSlice(op["tags"]), any(wantTag)) {
					t.Errorf("api/openapi.yaml: %s is not tagged %q", where, wantTag)
				}
				if len(asMap(op["responses"])) == 0 {
					t.Errorf("api/openapi.yaml: %s documents no responses", where)
				}
				checkPathParams(t, doc.raw, where, path, item, op)
				checkRetryable(t, doc.raw, where, op)
			}
		}
	})

	ns := natstest.New(t)
	nc, js := ns.Connect(t)
	// Every optional route on: the document describes them all, and says
	// which ones a setting switches (the demo's simulate endpoint).
	cfg, err := LoadConfig(func(k string) string { return map[string]string{"PAYMENT_FAKE_PROVIDER": "true"}[k] })
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	checker, err := apitest.New()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range services.Deployed() {
		name := e.Name
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			handler := assembled(t, e, cfg, nc, js, log)
			r, ok := handler.(chi.Routes)
			if !ok {
				t.Fatalf("the %s service's handler is a %T, not a chi router", name, handler)
			}

			served := map[string]bool{}
			err := chi.Walk(r, func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
				served[method+" "+chiPattern(route)] = true
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(served) == 0 {
				t.Fatalf("the %s router serves no routes", name)
			}
			// HEAD is served wherever GET is, by middleware, which
			// chi.Walk does not see: ask the running router, through a
			// client whose every response is checked against the
			// document (the GET's too).
			hs := httptest.NewServer(handler)
			t.Cleanup(hs.Close)
			client := &http.Client{Transport: checker.Transport(nil)}
			for _, op := range slices.Sorted(maps.Keys(served)) {
				route, ok := strings.CutPrefix(op, http.MethodGet+" ")
				if !ok {
					continue
				}
				path := strings.NewReplacer("{id}", uuid.NewString(), "{order_id}", uuid.NewString(), "{sku}", "SKU-1").Replace(route)
				for _, method := range []string{http.MethodGet, http.MethodHead} {
					req, _ := http.NewRequest(method, hs.URL+path, nil)
					res, err := client.Do(req)
					if err != nil {
						t.Errorf("%s %s: %v", method, path, err)
						continue
					}
					res.Body.Close()
					if method == http.MethodHead && res.StatusCode != http.StatusMethodNotAllowed {
						served[http.MethodHead+" "+route] = true
					}
				}
			}
			for _, op := range slices.Sorted(maps.Keys(served)) {
				switch service, ok := doc.ops[op]; {
				case !ok:
					t.Errorf("%s is served by the %s router but not documented in api/openapi.yaml: add it under paths with \"x-service\": %q (or %q if every service serves it)",
						op, name, name, xServiceAll)
				case service != name && service != xServiceAll:
					t.Errorf("%s is served by the %s router but api/openapi.yaml documents it for x-service %q", op, name, service)
				}
			}
			for _, op := range slices.Sorted(maps.Keys(doc.ops)) {
				service := doc.ops[op]
				if (service == name || service == xServiceAll) && !served[op] {
					t.Errorf("%s is documented in api/openapi.yaml for x-service %q but the %s router does not serve it", op, service, name)
				}
			}
		})
	}
}

// problemCode finds the code of every problem the server builds:
// httpx.NewProblem(status, "code", …) anywhere in the module.
var problemCode = regexp.MustCompile(`NewProblem\([^,()]+,\s*"([a-z-]+)"`)

// checkProblemCodes checks that Problem.code's enum is exactly the codes
// the server's source emits: a client that switches on the enum meets no
// surprise, and the document lists no code nothing sends.
func checkProblemCodes(t *testing.T, root any) {
	t.Helper()
	schema := asMap(asMap(asMap(asMap(asMap(root)["components"])["schemas"])["Problem"])["properties"])["code"]
	documented := map[string]bool{}
	for _, c := range asSlice(asMap(schema)["enum"]) {
		documented[c.(string)] = true
	}
	emitted := map[string]bool{}
	err := filepath.WalkDir("../../..", func(path string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case d.IsDir() && (d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && path != "../../..":
			return filepath.SkipDir
		case d.IsDir() && path == filepath.Join("../../..", "examples"):
			// The guide's example is not deployed: its API is not the
			// document's (services.Deployed).
			return filepath.SkipDir
		case d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go"):
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range problemCode.FindAllSubmatch(src, -1) {
			emitted[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(emitted) == 0 {
		t.Fatal("found no httpx.NewProblem calls in the module's source")
	}
	for _, c := range slices.Sorted(maps.Keys(emitted)) {
		if !documented[c] {
			t.Errorf("api/openapi.yaml: the server emits problem code %q, which Problem.code's enum lacks", c)
		}
	}
	for _, c := range slices.Sorted(maps.Keys(documented)) {
		if !emitted[c] {
			t.Errorf("api/openapi.yaml: Problem.code's enum lists %q, which no httpx.NewProblem call emits", c)
		}
	}
}

// checkRetryable holds op's 409 and 503 responses to the contract's rule:
// each says whether a client should send the request again (x-retryable),
// and exactly the retryable ones carry Retry-After, which every 503 is.
func checkRetryable(t *testing.T, root any, where string, op map[string]any) {
	t.Helper()
	for code, v := range asMap(op["responses"]) {
		if code != "409" && code != "503" {
			continue
		}
		res := asMap(resolveRef(root, v))
		retryable, ok := res["x-retryable"].(bool)
		_, retryAfter := asMap(res["headers"])["Retry-After"]
		switch {
		case !ok:
			t.Errorf("api/openapi.yaml: %s %s does not say whether it is retryable (x-retryable)", where, code)
		case retryable != retryAfter:
			t.Errorf("api/openapi.yaml: %s %s has x-retryable %v but Retry-After %v: a retryable answer carries it, a final one does not", where, code, retryable, retryAfter)
		case code == "503" && !retryable:
			t.Errorf("api/openapi.yaml: %s 503 is not retryable: every 503 is", where)
		}
	}
}

// chiParam is a chi URL parameter, with its optional regexp: {id:[0-9]+}.
var chiParam = regexp.MustCompile(`\{([^}:]+)(:[^}]*)?\}`)

// chiPattern turns a chi route pattern into an OpenAPI path: a parameter's
// regexp is dropped, the name kept.
func chiPattern(route string) string {
	return chiParam.ReplaceAllString(route, "{$1}")
}

// checkPathParams checks that the path parameters declared on a path item
// and its operation are exactly the {names} in its path.
func checkPathParams(t *testing.T, root any, where, path string, item, op map[string]any) {
	t.Helper()
	declared := map[string]bool{}
	for _, p := range slices.Concat(asSlice(item["parameters"]), asSlice(op["parameters"])) {
		param := asMap(resolveRef(root, p))
		if param["in"] == "path" {
			name, _ := param["name"].(string)
			declared[name] = true
		}
	}
	inPath := map[string]bool{}
	for _, m := range chiParam.FindAllStringSubmatch(path, -1) {
		inPath[m[1]] = true
		if !declared[m[1]] {
			t.Errorf("api/openapi.yaml: %s declares no path parameter %q", where, m[1])
		}
	}
	for name := range declared {
		if !inPath[name] {
			t.Errorf("api/openapi.yaml: %s declares path parameter %q, which its path does not have", where, name)
		}
	}
}

// checkRefs checks that every local $ref in v resolves.
func checkRefs(t *testing.T, root, v any, at string) {
	t.Helper()
	switch v := v.(type) {
	case map[string]any:
		if ref, ok := v["$ref"].(string); ok && resolveRef(root, v) == nil {
			t.Errorf("api/openapi.yaml: %s: $ref %q does not resolve", at, ref)
		}
		for k, e := range v {
			checkRefs(t, root, e, at+"/"+k)
		}
	case []any:
		for i, e := range v {
			checkRefs(t, root, e, fmt.Sprintf("%s/%d", at, i))
		}
	}
}

// resolveRef follows v's local $ref ("#/components/…"), if it has one; nil
// if it does not resolve.
func resolveRef(root, v any) any {
	ref, ok := asMap(v)["$ref"].(string)
	if !ok {
		return v
	}
	rest, ok := strings.CutPrefix(ref, "#/")
	if !ok {
		return nil
	}
	cur := root
	for _, tok := range strings.Split(rest, "/") {
		tok = strings.NewReplacer("~1", "/", "~0", "~").Replace(tok)
		cur = asMap(cur)[tok]
		if cur == nil {
			return nil
		}
	}
	return cur
}

func asMap(v any) map[string]any { m, _ := v.(map[string]any); return m }
func asSlice(v any) []any        { s, _ := v.([]any); return s }

// assembled is the router of service e exactly as a running service
// assembles it, over a schema of its own.
func assembled(t *testing.T, e registry.Entry, cfg config.Config, nc *nats.Conn, js jetstream.JetStream, log *slog.Logger) http.Handler {
	t.Helper()
	db := pgtest.New(t, e.Sets()...)
	svc, err := New(e.Name, cfg, nc, log)
	if err != nil {
		t.Fatal(err)
	}
	_, _, handler, err := svc.assemble(db.Pool, js)
	if err != nil {
		t.Fatal(err)
	}
	return handler
}
