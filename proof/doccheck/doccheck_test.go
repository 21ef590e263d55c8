// Package doccheck holds the docs to the code they point at: a row of
// docs/failure-windows.md that names a file, a function in it or a test is
// a promise, and files move (issue 13 split several by concern).
package doccheck

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

const root = "../.."

var (
	// `pkg/outbox/steps.go:settle`, `batch.go:settle`, `outbox.go:Writer.Queue`
	fileRef = regexp.MustCompile("`((?:[a-z0-9_]+/)*[a-z0-9_]+\\.go)(?::([A-Za-z_][A-Za-z0-9_.]*))?")
	// `TestAdd/commit leaves…`, `FuzzEnvelope`
	testRef = regexp.MustCompile("`((?:Test|Fuzz|Benchmark)[A-Z][A-Za-z0-9_]*)")
)

// TestFailureWindowsPointAtRealCode checks every file, function and test
// that docs/failure-windows.md names: the file exists (a bare file name
// must exist in a directory the same row names), the identifier occurs in
// it, and each test function is declared in some _test.go file.
func TestFailureWindowsPointAtRealCode(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(root, "docs", "failure-windows.md"))
	if err != nil {
		t.Fatal(err)
	}
	tests := declaredTests(t)
	for n, line := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(line, "|") {
			continue
		}
		var dirs []string
		for _, m := range fileRef.FindAllStringSubmatch(line, -1) {
			if strings.Contains(m[1], "/") {
				dirs = append(dirs, filepath.Dir(m[1]))
			}
		}
		for _, m := range fileRef.FindAllStringSubmatch(line, -1) {
			path := findFile(m[1], dirs)
			if path == "" {
				t.Errorf("docs/failure-windows.md:%d names %s, which does not exist", n+1, m[1])
				continue
			}
			if m[2] == "" {
				continue
			}
			src, err := os.ReadFile(filepath.Join(root, path))
			if err != nil {
				t.Fatal(err)
			}
			parts := strings.Split(m[2], ".")
			ident := parts[len(parts)-1]
			if !regexp.MustCompile(`\b` + regexp.QuoteMeta(ident) + `\b`).Match(src) {
				t.Errorf("docs/failure-windows.md:%d names %s:%s, but %s has no %s", n+1, m[1], m[2], path, ident)
			}
		}
		for _, m := range testRef.FindAllStringSubmatch(line, -1) {
			if !tests[m[1]] {
				t.Errorf("docs/failure-windows.md:%d names test %s, which no _test.go file declares", n+1, m[1])
			}
		}
	}
}

// findFile resolves a file the doc names: a path from the module root, or
// a bare name in one of dirs.
func findFile(name string, dirs []string) string {
	if strings.Contains(name, "/") {
		if _, err := os.Stat(filepath.Join(root, name)); err == nil {
			return name
		}
		return ""
	}
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if _, err := os.Stat(filepath.Join(root, p)); err == nil {
			return p
		}
	}
	return ""
}

// declaredTests is every Test, Fuzz and Benchmark function of the module.
func declaredTests(t *testing.T) map[string]bool {
	decl := regexp.MustCompile(`(?m)^func ((?:Test|Fuzz|Benchmark)[A-Za-z0-9_]*)\(`)
	found := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && p != root {
			return filepath.SkipDir
		}
		if !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range decl.FindAllSubmatch(src, -1) {
			found[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}
