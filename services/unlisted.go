package services

import (
	"embed"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path"
	"slices"
)

// registrations are the services' declarations as the binary was built
// from them, so that the binary itself knows which service packages exist.
//
//go:embed */registration.go
var registrations embed.FS

// Unlisted reports every package under services/ whose registration.go
// declares a Registration that All does not list. Such a service is
// compiled into nothing (no command, schema, NATS user, stream) and would
// otherwise be absent without a word; every command of shop refuses to
// start instead, naming the line to add.
func Unlisted() error { return unlisted(registrations, All.Names()) }

// unlisted is Unlisted over the registration.go files of fsys and the
// services listed.
func unlisted(fsys fs.FS, listed []string) error {
	files, err := fs.Glob(fsys, "*/registration.go")
	if err != nil {
		return fmt.Errorf("list services/*/registration.go: %w", err)
	}
	var errs []error
	for _, file := range files {
		src, err := fs.ReadFile(fsys, file)
		if err != nil {
			return fmt.Errorf("read services/%s: %w", file, err)
		}
		f, err := parser.ParseFile(token.NewFileSet(), file, src, parser.SkipObjectResolution)
		if err != nil {
			return fmt.Errorf("parse services/%s: %w", file, err)
		}
		dir := path.Dir(file)
		if declaresRegistration(f) && !slices.Contains(listed, dir) {
			errs = append(errs, fmt.Errorf("services/%s declares a Registration, but services.All does not list it, so this shop would never run it: "+
				"add the line `%s.Registration,` to All in services/services.go, with its import \"github.com/shop-ref/shop/services/%s\" "+
				"(docs/adding-a-service.md), or delete the directory", dir, f.Name.Name, dir))
		}
	}
	return errors.Join(errs...)
}

// declaresRegistration reports whether f declares a package-level variable
// called Registration.
func declaresRegistration(f *ast.File) bool {
	for _, decl := range f.Decls {
		if gen, ok := decl.(*ast.GenDecl); ok && gen.Tok == token.VAR {
			for _, spec := range gen.Specs {
				for _, name := range spec.(*ast.ValueSpec).Names {
					if name.Name == "Registration" {
						return true
					}
				}
			}
		}
	}
	return false
}
