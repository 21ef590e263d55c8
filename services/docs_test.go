package services_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/shop-ref/shop/services"
)

// docs/events.md describes every stream, producer and consumer of the
// shop: a section per stream with its prefix, a row in "Who consumes what"
// per consumer with its stream and the types it handles, and every event
// type a service's facts announce. A service added without its events
// documented fails here, naming what to add.
func TestEventsDocumentEveryStreamAndConsumer(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../docs/events.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	_, consumers, ok := strings.Cut(doc, "## Who consumes what")
	if !ok {
		t.Fatal(`docs/events.md has no section "## Who consumes what"`)
	}
	consumers, _, _ = strings.Cut(consumers, "\n## ")
	for _, e := range services.Deployed() {
		head := "## " + e.Stream + " (prefix `" + e.Prefix + "`"
		if !strings.Contains(doc, head) {
			t.Errorf("docs/events.md has no section %q…): add the %s service's events, a table of type, payload and when", head, e.Name)
		}
		for _, f := range e.Facts {
			if !strings.Contains(doc, "| `"+f.EventType+"` |") {
				t.Errorf("docs/events.md has no row for %s's %s", e.Name, f.EventType)
			}
		}
		for _, c := range e.Consumers {
			row := regexp.MustCompile("(?m)^\\| `" + regexp.QuoteMeta(c.Name) + "` \\| " + regexp.QuoteMeta(c.Stream) + "\\b.*\\|(.*)\\|$").FindStringSubmatch(consumers)
			if row == nil {
				t.Errorf("docs/events.md \"Who consumes what\" has no row `%s` | %s | <the types it handles> (the %s service's consumer)", c.Name, c.Stream, e.Name)
				continue
			}
			want := c.Handles
			if want == nil {
				want = c.Types
			}
			for _, typ := range want {
				if !strings.Contains(row[1], "`"+typ+"`") {
					t.Errorf("docs/events.md \"Who consumes what\": %s handles %s, which its row does not list", c.Name, typ)
				}
			}
		}
	}
}

// The README's prose that counts the services ("the four services")
// counts services.Deployed(): a fork's fifth service makes it say so. (The
// README is a file the guide has a fork edit anyway; the other documents'
// counts describe the shop as shipped.)
func TestDocsCountTheServices(t *testing.T) {
	t.Parallel()
	words := []string{"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"}
	want := len(services.Deployed())
	count := regexp.MustCompile(`(?i)\b(?:the|of) (two|three|four|five|six|seven|eight|nine|ten) services\b`)
	for _, file := range []string{"../README.md"} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, m := range count.FindAllStringSubmatch(line, -1) {
				if !strings.EqualFold(m[1], words[min(want, len(words)-1)]) {
					t.Errorf("%s:%d says %q; the shop has %d (services.All, without its examples): %s",
						strings.TrimPrefix(file, "../"), i+1, m[0], want, strings.Join(services.Deployed().Names(), ", "))
				}
			}
		}
	}
}
