package services_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/shop-ref/shop/services"
)

// The shop's registry is complete: every service has a name, schema, stream,
// subject prefix, address, pool size, constructor and migrations, none
// shared with another, and every consumer reads a stream some service
// owns (registry.Validate; every command checks it at start-up too).
func TestAllIsValid(t *testing.T) {
	if err := services.All.Validate(); err != nil {
		t.Fatal(err)
	}
}

// A service package that declares a Registration but is not in All would
// be compiled into nothing: no command, no schema, no NATS user, and its
// <NAME>_ADDR ignored. Every directory under services/ whose package
// declares a Registration is listed in All, in services.go.
func TestEveryServicePackageIsInAll(t *testing.T) {
	t.Parallel()
	const module = "github.com/shop-ref/shop/services/"
	fset := token.NewFileSet()
	registry, err := parser.ParseFile(fset, "services.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	// The packages services.go imports, by the name it calls them, and the
	// names whose Registration All lists.
	imported := map[string]string{} // import path → name in services.go
	for _, imp := range registry.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		name := filepath.Base(path)
		if imp.Name != nil {
			name = imp.Name.Name
		}
		imported[path] = name
	}
	listed := map[string]bool{}
	ast.Inspect(registry, func(n ast.Node) bool {
		spec, ok := n.(*ast.ValueSpec)
		if !ok || len(spec.Names) != 1 || spec.Names[0].Name != "All" || len(spec.Values) != 1 {
			return true
		}
		// All is a list, or a list with the Examples appended.
		ast.Inspect(spec.Values[0], func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok && sel.Sel.Name == "Registration" {
				if x, ok := sel.X.(*ast.Ident); ok {
					listed[x.Name] = true
				}
			}
			return true
		})
		return false
	})
	if len(listed) == 0 {
		t.Fatal("found no <service>.Registration in All in services/services.go: the test cannot read it any more")
	}

	dirs, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	found := 0
	for _, d := range dirs {
		if !d.IsDir() {
			continue
		}
		pkg, ok, err := registrationIn(fset, d.Name())
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			continue
		}
		found++
		path := module + d.Name()
		if name, ok := imported[path]; !ok || !listed[name] {
			t.Errorf("services/%s declares a Registration, but services.All does not list it, so the shop never runs it: "+
				"add the line `%s.Registration,` to All in services/services.go, and its import %q", d.Name(), pkg, path)
		}
	}
	if want := len(services.All) - len(services.Examples); found != want {
		t.Errorf("found %d packages under services/ with a Registration, services.All has %d entries besides its examples", found, want)
	}
	// The binary says the same at start-up, from the registration.go
	// files it embeds.
	if err := services.Unlisted(); err != nil {
		t.Error(err)
	}
}

// registrationIn reports whether the package in dir declares a
// package-level variable called Registration, and the package's name.
func registrationIn(fset *token.FileSet, dir string) (pkg string, ok bool, err error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return "", false, err
	}
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
		if err != nil {
			return "", false, err
		}
		for _, decl := range f.Decls {
			gen, isGen := decl.(*ast.GenDecl)
			if !isGen || gen.Tok != token.VAR {
				continue
			}
			for _, spec := range gen.Specs {
				for _, name := range spec.(*ast.ValueSpec).Names {
					if name.Name == "Registration" {
						return f.Name.Name, true, nil
					}
				}
			}
		}
	}
	return "", false, nil
}
