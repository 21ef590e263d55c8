package pgtest

import (
	"context"
	"fmt"
	"strings"
	"testing"
)

// Dump runs queries on the schema and returns their rows as text, one line
// per row: what a test compares when two schemas must end up the same (a
// batches of random sizes against batches of one, say). The queries
// should order their rows and leave out what differs by nature (times,
// generated ids).
func (s *Schema) Dump(t testing.TB, queries ...string) string {
	t.Helper()
	var out strings.Builder
	for _, q := range queries {
		rows, err := s.Pool.Query(context.Background(), q)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				t.Fatalf("%s: %v", q, err)
			}
			fmt.Fprintln(&out, vals...)
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	return out.String()
}
