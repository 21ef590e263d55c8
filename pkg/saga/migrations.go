package saga

import (
	"embed"
	"io/fs"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations returns the SQL that creates the saga's tables (saga_instances, saga_timeouts, saga_unexpected): goose migration files,
// numbered from 00001, to apply in order in the schema that Saga and Scanner
// use, with a version table of the package's own so that they never
// interleave with the application's migrations. Every Up statement is
// idempotent, so they also apply to a schema that already has the tables.
// Copying this package's directory is all another project needs to use it.
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err) // unreachable: the directory is embedded, and its name is valid
	}
	return sub
}
