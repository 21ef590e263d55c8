package failpoint_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/shop-ref/shop/internal/failpoint"
)

// The libraries cannot import this package: each documents the names it
// passes to its Hooks.FailpointFunc, and its own failpoint tests hold its
// code to them. Those names and the registry's must be the same, or Init
// would refuse the name of a point that exists, or accept one that never
// fires.
func TestLibraryNamesAreRegistered(t *testing.T) {
	quoted := regexp.MustCompile(`"((?:outbox|inbox|saga)\.[a-z_]+)"`)
	var documented []string
	for _, lib := range []string{"outbox", "inbox", "saga"} {
		doc := failpointFuncDoc(t, filepath.Join("..", "..", "pkg", lib))
		names := quoted.FindAllStringSubmatch(doc, -1)
		if len(names) == 0 {
			t.Errorf("pkg/%s: Hooks.FailpointFunc documents no failpoint names", lib)
		}
		for _, m := range names {
			documented = append(documented, m[1])
		}
	}
	for _, n := range documented {
		if !slices.Contains(failpoint.Names(), n) {
			t.Errorf("library failpoint %q is not in failpoint.Names()", n)
		}
	}
	for _, n := range failpoint.Names() {
		lib, _, _ := strings.Cut(n, ".")
		if (lib == "outbox" || lib == "inbox" || lib == "saga") && !slices.Contains(documented, n) {
			t.Errorf("failpoint %q is registered, but pkg/%s does not document it", n, lib)
		}
	}
}

// failpointFuncDoc returns the doc comment of the FailpointFunc field of
// type Hooks in the package in dir.
func failpointFuncDoc(t *testing.T, dir string) string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok {
				continue
			}
			for _, s := range g.Specs {
				ts, ok := s.(*ast.TypeSpec)
				if !ok || ts.Name.Name != "Hooks" {
					continue
				}
				st, ok := ts.Type.(*ast.StructType)
				if !ok {
					continue
				}
				for _, fld := range st.Fields.List {
					if len(fld.Names) == 1 && fld.Names[0].Name == "FailpointFunc" && fld.Doc != nil {
						return fld.Doc.Text()
					}
				}
			}
		}
	}
	t.Fatalf("%s: no documented Hooks.FailpointFunc", dir)
	return ""
}
