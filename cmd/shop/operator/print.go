package operator

import (
	"encoding/json"
	"io"
	"text/tabwriter"
)

// printJSON prints v as indented JSON: the --json output of every command.
func (c *command) printJSON(v any) error {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// newTable returns the aligned columns every table of the commands is
// printed in.
func newTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 4, 2, ' ', 0) }

// rawJSON returns b as a JSON value: itself when it is valid JSON, else a
// JSON string.
func rawJSON(b []byte) json.RawMessage {
	if json.Valid(b) {
		return json.RawMessage(b)
	}
	s, _ := json.Marshal(string(b))
	return s
}
