package services_test

// The fifth service of docs/adding-a-service.md, examples/loyalty, beside
// the shop's other services as a fork's would run: migrated by `shop
// migrate`, its consumers reading ORDERS and PAYMENT under its own NATS
// user, its relay publishing PointsAwarded, listed by `shop outbox status`,
// checked by `shop verify`. The snippets of the guide are taken from
// examples/loyalty (TestGuideQuotesTheFifthService), so the guide cannot
// describe code that does not work.

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shop-ref/shop/cmd/shop/operator"
	"github.com/shop-ref/shop/examples/loyalty"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// The guide's promise: a fifth service is its package, its migrations and
// one registry line — here the append — and every part of the shop picks
// it up: migrate creates its schema, its user may consume ORDERS and
// publish to LOYALTY, its consumer applies the order events, its relay
// publishes PointsAwarded, shop outbox status lists it, shop verify checks
// its facts, its check and its consumer, and the order service's admission
// does not count it.
func TestAFifthServiceJoinsTheShop(t *testing.T) {
	t.Parallel()
	// A fork that followed the guide has this service in services.All,
	// with its SQL in migrations/loyalty/: the journey is then its own.
	// With the fifthservice tag (make test's second run) All has it
	// already.
	reg := services.All
	if _, err := services.All.Get(loyalty.Registration.Name); err != nil {
		reg = append(append(registry.Registry{}, services.All...), loyalty.Registration)
	}
	shop := shoptest.StartFor(t, reg) // migrates every schema as each service starts
	op := operator.Shop{Services: reg}
	getenv := func(k string) string { return shop.Env[k] }
	ctx := t.Context()

	// `shop migrate loyalty` applies its schema again: nothing pending.
	if err := op.Migrate(ctx, []string{"loyalty"}, getenv, io.Discard, io.Discard); err != nil {
		t.Fatalf("shop migrate loyalty: %v", err)
	}

	// A customer with no points is a 404 problem, not {"points":0}.
	res, err := http.Get(shop.URLs["loyalty"] + "/points/c-loyal")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusNotFound || res.Header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("GET /points of an unknown customer: %s %q, want a 404 problem", res.Status, res.Header.Get("Content-Type"))
	}

	shop.Restock(t, "SKU-LOYAL", 10, 1250)
	_, total := shop.Complete(t, "c-loyal", "SKU-LOYAL", 2)
	poll.Until(t, 20*time.Second, "the points of c-loyal", func() bool {
		res, err := http.Get(shop.URLs["loyalty"] + "/points/c-loyal")
		if err != nil {
			return false
		}
		defer res.Body.Close()
		var p struct{ Points int64 }
		return json.NewDecoder(res.Body).Decode(&p) == nil && p.Points == total/100
	})

	// shop outbox status: its row, PointsAwarded published.
	poll.Until(t, 20*time.Second, "PointsAwarded published", func() bool {
		var out strings.Builder
		if err := op.Outbox(ctx, []string{"status", "--json"}, getenv, &out, io.Discard); err != nil {
			t.Fatalf("shop outbox status: %v", err)
		}
		var status []struct {
			Service string
			Pending int64
		}
		if err := json.Unmarshal([]byte(out.String()), &status); err != nil {
			t.Fatalf("shop outbox status --json: %v\n%s", err, out.String())
		}
		for _, s := range status {
			if s.Service == "loyalty" {
				return s.Pending == 0
			}
		}
		t.Fatalf("shop outbox status lists no loyalty service:\n%s", out.String())
		return false
	})

	// shop verify: every invariant holds, the loyalty service's among them.
	var report strings.Builder
	err = op.Verify(ctx, []string{"-wait", "30s"}, getenv, &report, io.Discard)
	if err != nil {
		t.Fatalf("shop verify: %v\n%s", err, report.String())
	}
	for _, want := range []string{
		"loyalty: each award has exactly one PointsAwarded",
		"loyalty: each customer's points are the sum of their awards",
		"loyalty-orders processed every order event",
		"loyalty-payment processed every payment event",
		"loyalty: stream LOYALTY holds every event marked published",
	} {
		if !strings.Contains(report.String(), "ok   invariant") || !strings.Contains(report.String(), want) {
			t.Errorf("shop verify does not report %q:\n%s", want, report.String())
		}
	}
}

// The guide's code blocks are examples/loyalty's, between its "guide:"
// markers: what a forker copies from the guide is what the suite runs.
func TestGuideQuotesTheFifthService(t *testing.T) {
	t.Parallel()
	guide, err := os.ReadFile("../docs/adding-a-service.md")
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob("../examples/loyalty/*")
	if err != nil {
		t.Fatal(err)
	}
	var src []byte
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, b...)
		if strings.HasSuffix(f, ".sql") && !strings.Contains(string(guide), strings.TrimSpace(string(b))) {
			t.Errorf("docs/adding-a-service.md does not quote %s as it is now; copy it again:\n%s", f, b)
		}
	}
	parts := regexp.MustCompile(`(?s)// guide: (\w+)\n(.*?)\n// guide: end \w+\n`).FindAllStringSubmatch(string(src), -1)
	if len(parts) < 4 {
		t.Fatalf("found %d guide parts in examples/loyalty, want the registration, constructor, handler and http", len(parts))
	}
	for _, p := range parts {
		if !strings.Contains(string(guide), strings.TrimSpace(p[2])) {
			t.Errorf("docs/adding-a-service.md does not quote the %s of examples/loyalty as it is now; copy it again:\n%s", p[1], p[2])
		}
	}
}
