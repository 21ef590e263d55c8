// Package migrations holds the SQL that creates pkg/outbox's tables (outbox, outbox_sequences and outbox_relays, where relays say they are alive): goose migration
// files, numbered from 00001, to apply in order in the schema that the outbox's Writer and Relay
// use, with a version table of their own so that they never interleave
// with the application's migrations. Every Up statement is idempotent, so
// they also apply to a schema that already has the tables. The package has
// no dependencies: copying pkg/outbox's directory is all another project needs.
package migrations

import (
	"embed"
	"io/fs"
)

//go:embed *.sql
var files embed.FS

// FS returns the migration files.
func FS() fs.FS { return files }
