package httpx

import (
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
)

// The contract's ids are checked here, one function per kind, and every
// route and request field that takes one calls it before the value goes
// anywhere else. A value that cannot be an id (a NUL, which Postgres text
// cannot hold; invalid UTF-8, which it refuses; a 10 KB string; "..%2F..")
// is then a 4xx problem instead of a query that fails with a 500.

// OrderID parses raw, an order id taken from a path, as the UUID every order
// id is, in the canonical form JSON Schema's "uuid" format names (36
// characters with hyphens; either case). ok is false for anything else: such
// an id names no order, and the caller answers it as it answers an unknown
// one (its 404) without asking the database.
func OrderID(raw string) (id uuid.UUID, ok bool) {
	// uuid.Parse also takes the braced, urn: and hyphenless forms; the
	// contract does not, and the length check keeps a 10 KB value from
	// being looked at further.
	if len(raw) != 36 {
		return uuid.Nil, false
	}
	id, err := uuid.Parse(raw)
	return id, err == nil
}

// MaxSKULen is the longest SKU the contract allows.
const MaxSKULen = 64

// ValidSKU reports whether sku has the contract's syntax,
// ^[A-Za-z0-9_-]{1,64}$ (api/openapi.yaml, schema Sku). ASCII only, which
// also makes a SKU a safe NATS subject token.
func ValidSKU(sku string) bool {
	if len(sku) == 0 || len(sku) > MaxSKULen {
		return false
	}
	for i := range len(sku) {
		c := sku[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// Text checks field, a string the contract bounds with minLength 1 and
// maxLength max (a customer id, a provider's payment id): 1 to max
// characters counted as JSON Schema counts them, in code points, not bytes
// (64 four-byte emoji fit a maxLength of 64), valid UTF-8 and printable
// only. Control characters are no one's id, and NUL, which Postgres text
// cannot hold, would fail the write with a 500. A refusal is a 422.
func Text(field, s string, max int) error {
	if n := utf8.RuneCountInString(s); n < 1 || n > max {
		return Invalid("%s must be 1 to %d characters, not %d", field, max, n)
	}
	if !utf8.ValidString(s) || strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) {
		return Invalid("%s may hold printable characters only", field)
	}
	return nil
}
