package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// decls is what some Go files declare: top-level names, and Type.Member
// for a struct's fields (embedded ones by their type's name), an
// interface's methods and any type's methods.
type decls struct {
	top      map[string]bool
	members  map[string]bool
	embedded map[string][]string // type → the types it embeds
}

// has reports whether name ("Name" or "Type.Member") is declared. A bare
// name may be a method too (`steps.go:settle` names (*relay).settle); a
// member may be promoted from an embedded type.
func (d decls) has(name string) bool {
	typ, member, dotted := strings.Cut(name, ".")
	if !dotted {
		if d.top[name] {
			return true
		}
		for m := range d.members {
			if strings.HasSuffix(m, "."+name) {
				return true
			}
		}
		return false
	}
	return d.member(typ, member, 0)
}

func (d decls) member(typ, member string, depth int) bool {
	if d.members[typ+"."+member] {
		return true
	}
	if depth > 4 {
		return false
	}
	for _, e := range d.embedded[typ] {
		if d.member(e, member, depth+1) {
			return true
		}
	}
	return false
}

// parseFiles reads the declarations of the given Go files.
func parseFiles(paths ...string) (decls, error) {
	d := decls{top: map[string]bool{}, members: map[string]bool{}, embedded: map[string][]string{}}
	fset := token.NewFileSet()
	for _, p := range paths {
		f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
		if err != nil {
			return d, err
		}
		d.add(f)
	}
	return d, nil
}

func (d decls) add(f *ast.File) {
	for _, decl := range f.Decls {
		switch decl := decl.(type) {
		case *ast.FuncDecl:
			if decl.Recv == nil || len(decl.Recv.List) == 0 {
				d.top[decl.Name.Name] = true
				continue
			}
			d.members[typeName(decl.Recv.List[0].Type)+"."+decl.Name.Name] = true
		case *ast.GenDecl:
			for _, spec := range decl.Specs {
				switch spec := spec.(type) {
				case *ast.ValueSpec:
					for _, n := range spec.Names {
						d.top[n.Name] = true
					}
				case *ast.TypeSpec:
					d.top[spec.Name.Name] = true
					d.addType(spec.Name.Name, spec.Type)
				}
			}
		}
	}
}

func (d decls) addType(name string, typ ast.Expr) {
	switch typ := typ.(type) {
	case *ast.StructType:
		for _, f := range typ.Fields.List {
			if len(f.Names) == 0 {
				e := typeName(f.Type)
				d.members[name+"."+e] = true
				d.embedded[name] = append(d.embedded[name], e)
			}
			for _, n := range f.Names {
				d.members[name+"."+n.Name] = true
			}
		}
	case *ast.InterfaceType:
		for _, m := range typ.Methods.List {
			for _, n := range m.Names {
				d.members[name+"."+n.Name] = true
			}
		}
	}
}

// typeName is the name of a receiver or embedded type: T for T, *T,
// T[K], pkg.T.
func typeName(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.StarExpr:
		return typeName(e.X)
	case *ast.IndexExpr:
		return typeName(e.X)
	case *ast.IndexListExpr:
		return typeName(e.X)
	case *ast.SelectorExpr:
		return e.Sel.Name
	case *ast.Ident:
		return e.Name
	}
	return ""
}

// packages are the module's packages by directory and by name, with what
// their non-test files declare.
type packages struct {
	byDir  map[string]decls
	byName map[string][]string
}

func modulePackages() (packages, error) {
	pkgs := packages{byDir: map[string]decls{}, byName: map[string][]string{}}
	files := map[string][]string{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (d.Name() == "node_modules" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") {
			rel, err := filepath.Rel(root, filepath.Dir(p))
			if err != nil {
				return err
			}
			files[filepath.ToSlash(rel)] = append(files[filepath.ToSlash(rel)], p)
		}
		return nil
	})
	if err != nil {
		return pkgs, err
	}
	for dir, paths := range files {
		f, err := parser.ParseFile(token.NewFileSet(), paths[0], nil, parser.PackageClauseOnly)
		if err != nil {
			return pkgs, err
		}
		if f.Name.Name == "main" {
			continue
		}
		d, err := parseFiles(paths...)
		if err != nil {
			return pkgs, err
		}
		pkgs.byDir[dir] = d
		pkgs.byName[f.Name.Name] = append(pkgs.byName[f.Name.Name], dir)
	}
	return pkgs, nil
}

// The declaration reader is what every name rule of this package trusts:
// a reader that found nothing would make each rule fail on every doc, one
// that found everything would make each rule pass vacuously.
func TestDeclsReadWhatAFileDeclares(t *testing.T) {
	src := `package p
type Base struct{ ID int }
type Relay struct {
	Base
	name string
}
func (r *Relay) settle() {}
type Store interface{ Load() }
const limit = 1
func New() *Relay { return nil }
`
	path := filepath.Join(t.TempDir(), "p.go")
	if err := os.WriteFile(path, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	d, err := parseFiles(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"New", "limit", "Relay", "Relay.name", "Relay.settle", "settle", "Relay.Base", "Relay.ID", "Store.Load"} {
		if !d.has(name) {
			t.Errorf("has(%q) = false, want true", name)
		}
	}
	for _, name := range []string{"Missing", "Relay.missing", "Store.Save", "Base.name", "load"} {
		if d.has(name) {
			t.Errorf("has(%q) = true, want false", name)
		}
	}
}
