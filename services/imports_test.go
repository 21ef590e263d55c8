package services_test

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// One composition root: only cmd/shop imports package services to wire
// services.All; every other package receives the registry as a parameter
// (registry.Registry) from there, so a reader finds in one place which
// services a command runs. Tests may import it (_test.go files), and so
// may services' own subpackages' tests. Every file is checked, whatever
// its build tags.
func TestOnlyCmdShopWiresTheServices(t *testing.T) {
	const pkg = "github.com/shop-ref/shop/services"
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("the module root is not %s: %v", root, err)
	}
	checked := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			name := d.Name()
			if rel != "." && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "vendor" || name == "node_modules") {
				return filepath.SkipDir
			}
			if rel == "cmd/shop" || rel == "services" || strings.HasPrefix(rel, "services/") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		checked++
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == pkg {
				t.Errorf("%s imports %s: only cmd/shop wires services.All (one composition root); "+
					"take the services as a registry.Registry parameter from cmd/shop instead (a _test.go file may import it)", rel, pkg)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 50 { // the walk went wrong: the rule would hold vacuously
		t.Fatalf("checked only %d files under %s", checked, root)
	}
}

// rooms are the module's top folders, from the top down: a file may import
// its own room and the rooms below it, never one above. The README's
// "Layout" section draws the same list.
var rooms = []string{"proof", "cmd", "ops", "services", "examples", "internal", "pkg"}

// roomOf is the room of a module-relative path or import path ("" for one
// outside the rooms, such as migrations).
func roomOf(rel string) int {
	first, _, _ := strings.Cut(rel, "/")
	for i, r := range rooms {
		if first == r {
			return i
		}
	}
	return -1
}

// TestImportsGoDown: product, operations and proof live apart, and a
// reader of a room needs nothing from the rooms above it. Test files may
// import anything (a test of the product uses the proof's helpers).
func TestImportsGoDown(t *testing.T) {
	const module = "github.com/shop-ref/shop/"
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if name := d.Name(); rel != "." && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		from := roomOf(rel)
		if from < 0 || !strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		checked++
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			target, ok := strings.CutPrefix(p, module)
			if !ok {
				continue
			}
			if to := roomOf(target); to >= 0 && to < from {
				t.Errorf("%s (%s/) imports %s, in %s/ above it: imports go down %v", rel, rooms[from], p, rooms[to], rooms)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 100 {
		t.Fatalf("checked only %d files under %s", checked, root)
	}
}
