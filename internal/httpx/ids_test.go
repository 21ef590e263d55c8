package httpx

import (
	"errors"
	"net/http"
	"strings"
	"testing"
)

// hostile returns values no id of the shop can be: each check must refuse
// them (and any caller turns that into a 4xx before a query).
func hostile() map[string]string {
	return map[string]string{
		"empty":              "",
		"NUL":                "\x00",
		"NUL after an id":    "0193a6c2-7d4e-7c3a-9f1e-2b5d8c4a6e1\x00",
		"invalid UTF-8":      "\xff\xfe",
		"10 KB":              strings.Repeat("a", 10<<10),
		"traversal":          "../..",
		"escaped traversal":  "..%2F..",
		"a space":            "SKU 1",
		"a subject wildcard": "SKU.>",
	}
}

func TestOrderID(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"0193a6c2-7d4e-7c3a-9f1e-2b5d8c4a6e10", "0193A6C2-7D4E-7C3A-9F1E-2B5D8C4A6E10"} {
		if id, valid := OrderID(ok); !valid || !strings.EqualFold(id.String(), ok) {
			t.Errorf("OrderID(%q) = %v %v, want it parsed", ok, id, valid)
		}
	}
	refused := map[string]string{
		"hyphenless": "0193a6c27d4e7c3a9f1e2b5d8c4a6e10",
		"braced":     "{0193a6c2-7d4e-7c3a-9f1e-2b5d8c4a6e10}",
		"urn":        "urn:uuid:0193a6c2-7d4e-7c3a-9f1e-2b5d8c4a6e10",
		"not hex":    "0193a6c2-7d4e-7c3a-9f1e-2b5d8c4a6e1g",
	}
	for name, v := range hostile() {
		refused[name] = v
	}
	for name, v := range refused {
		if _, ok := OrderID(v); ok {
			t.Errorf("%s: OrderID(%.40q) accepted", name, v)
		}
	}
}

func TestValidSKU(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"SKU-1", "a", "a_b-C9", strings.Repeat("x", MaxSKULen)} {
		if !ValidSKU(ok) {
			t.Errorf("ValidSKU(%q) = false", ok)
		}
	}
	refused := map[string]string{"65 characters": strings.Repeat("x", MaxSKULen+1), "non-ASCII letter": "SKÜ"}
	for name, v := range hostile() {
		refused[name] = v
	}
	for name, v := range refused {
		if ValidSKU(v) {
			t.Errorf("%s: ValidSKU(%.40q) = true", name, v)
		}
	}
}

// JSON Schema's maxLength counts characters (code points): 64 four-byte
// emoji are 64 characters and 256 bytes, and a maxLength of 64 allows them.
func TestTextCountsCharactersNotBytes(t *testing.T) {
	t.Parallel()
	const emoji = "\U0001F600" // 4 bytes in UTF-8
	for _, c := range []struct {
		name string
		s    string
		ok   bool
	}{
		{"64 four-byte emoji", strings.Repeat(emoji, 64), true},
		{"65 four-byte emoji", strings.Repeat(emoji, 65), false},
		{"64 ASCII", strings.Repeat("c", 64), true},
		{"65 ASCII", strings.Repeat("c", 65), false},
		{"one character", "c", true},
		{"empty", "", false},
		{"NUL", "c\x00", false},
		{"a control character", "c\n", false},
		{"invalid UTF-8", "c\xff", false},
	} {
		err := Text("customer_id", c.s, 64)
		var p *Problem
		switch {
		case c.ok && err != nil:
			t.Errorf("%s: %v, want it accepted", c.name, err)
		case !c.ok && (!errors.As(err, &p) || p.Status != http.StatusUnprocessableEntity):
			t.Errorf("%s: %v, want a 422 problem", c.name, err)
		}
	}
}
