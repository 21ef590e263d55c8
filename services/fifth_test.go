package services_test

// The fifth service of docs/adding-a-service.md, for real: a loyalty service
// that credits a customer with points for each completed order. It lives
// only in this test (or, in a fork that followed the guide, in
// services/loyalty/, which the test then runs instead), which runs it
// beside the shop's other services as a forker's would run: migrated by `shop migrate`, its consumer reading
// ORDERS under its own NATS user, its relay publishing PointsAwarded, listed
// by `shop outbox status`, checked by `shop verify`. The snippets of the
// guide are taken from this file (TestGuideQuotesTheFifthService), so the
// guide cannot describe code that does not work.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shop-ref/shop/cmd/shop/operator"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

// guide: registration
var Registration = registry.Entry{
	Name:      "loyalty",
	Schema:    "loyalty",
	Stream:    "LOYALTY",
	Prefix:    prefix,
	Addr:      ":8085",
	PoolSize:  7, // the consumer's 2 workers (registry.ConsumerWorkers) plus two, the relay's three; docs/operating.md "Postgres connections"
	Consumers: []registry.Consumer{ordersConsumer},
	Configure: configure,
	Facts: []registry.Fact{{What: "award", EventType: "PointsAwarded", EventKey: "aggregate_id",
		SQL: `SELECT order_id AS key, 1 AS n FROM awards WHERE awarded_at > $1`}},
	Checks: []registry.Check{{Invariant: 4, Name: "each customer's points are the sum of their awards", SQL: `
		SELECT p.customer_id || ': ' || p.points || ' points, awards ' || coalesce(sum(a.points), 0)
		FROM points p LEFT JOIN awards a USING (customer_id)
		GROUP BY p.customer_id, p.points HAVING p.points <> coalesce(sum(a.points), 0)`}},
}

// prefix is the first token of the service's subjects: its stream's
// (loyalty.>) and those its outbox writer makes (<prefix>.<id>.<type>).
const prefix = "loyalty"

// ordersConsumer reads every order event, so that the inbox keeps each
// order's events in sequence (an OrderCompleted is never applied before its
// OrderCreated); it applies two types and only records the rest. Saga is
// false: a lagging loyalty service must never throttle POST /orders.
var ordersConsumer = registry.Consumer{Name: "loyalty-orders", Stream: "ORDERS",
	Handles: []string{"OrderCreated", "OrderCompleted"}}

// configure declares the service's own setting and returns its constructor.
func configure(env *registry.Env) registry.NewFunc {
	var cfg Config
	env.Count(&cfg.CentsPerPoint, "LOYALTY_CENTS_PER_POINT", 100, "order total, in cents, that earns one point")
	return func(d registry.Deps) (registry.Domain, error) { return New(d, cfg) }
}

// guide: end registration

// guide: migration
// migrations/loyalty/00002_loyalty.sql
const loyaltySQL = `
-- +goose Up
CREATE TABLE order_totals (
    order_id    text   PRIMARY KEY,
    customer_id text   NOT NULL,
    total       bigint NOT NULL
);
CREATE TABLE awards (
    order_id    text        PRIMARY KEY,
    customer_id text        NOT NULL,
    points      bigint      NOT NULL,
    awarded_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE points (
    customer_id text   PRIMARY KEY,
    points      bigint NOT NULL
);
`

// guide: end migration

// guide: constructor
// Config is the loyalty service's own settings.
type Config struct{ CentsPerPoint int64 }

// Service is the loyalty service.
type Service struct {
	pool     *pgxpool.Pool
	cfg      Config
	outbox   outbox.Writer
	consumer *inbox.Consumer
}

func New(d registry.Deps, cfg Config) (*Service, error) {
	// The writer makes each event's subject, <prefix>.<aggregate id>.<type>.
	s := &Service{pool: d.Pool, cfg: cfg, outbox: outbox.Writer{Prefix: prefix}}
	// d.Inbox gives the consumer the shop's windows, logger, tracer and
	// hooks; the declaration gives it its name, stream and types.
	c, err := inbox.NewConsumer(d.Pool, d.JetStream, d.Inbox(ordersConsumer, inbox.Each(s.handle)))
	if err != nil {
		return nil, fmt.Errorf("loyalty: %w", err)
	}
	s.consumer = c
	return s, nil
}

func (s *Service) Routes(r chi.Router)           { r.Get("/points/{customer}", s.getPoints) }
func (s *Service) Run(ctx context.Context) error { return s.consumer.Run(ctx) }
func (s *Service) Consumers() []*inbox.Consumer  { return []*inbox.Consumer{s.consumer} }

// guide: end constructor

// guide: handler
// handle applies one order event in the inbox's transaction: the points and
// the PointsAwarded event commit together, once, however often the
// OrderCompleted is delivered.
func (s *Service) handle(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	switch m.Type {
	case "OrderCreated":
		var o struct {
			OrderID    string `json:"order_id"`
			CustomerID string `json:"customer_id"`
			Total      int64  `json:"total"`
		}
		if err := json.Unmarshal(m.Data, &o); err != nil {
			return inbox.Poison(fmt.Errorf("decode OrderCreated: %w", err))
		}
		_, err := tx.Exec(ctx, `INSERT INTO order_totals (order_id, customer_id, total) VALUES ($1, $2, $3)`,
			o.OrderID, o.CustomerID, o.Total)
		return err
	case "OrderCompleted":
		var customer string
		var total int64
		err := tx.QueryRow(ctx, `SELECT customer_id, total FROM order_totals WHERE order_id = $1`,
			m.AggregateID).Scan(&customer, &total)
		if err != nil {
			return err // its OrderCreated came first: the inbox keeps the order's sequence
		}
		points := total / s.cfg.CentsPerPoint
		if _, err := tx.Exec(ctx, `INSERT INTO awards (order_id, customer_id, points) VALUES ($1, $2, $3)`,
			m.AggregateID, customer, points); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO points (customer_id, points) VALUES ($1, $2)
			ON CONFLICT (customer_id) DO UPDATE SET points = points.points + excluded.points`, customer, points); err != nil {
			return err
		}
		return s.outbox.Add(ctx, tx, outbox.Event{
			AggregateType: "order", AggregateID: m.AggregateID, Type: "PointsAwarded",
			Payload: map[string]any{"order_id": m.AggregateID, "customer_id": customer, "points": points},
		})
	}
	return nil // unreachable: Handles lists the two types above
}

// guide: end handler

// guide: http
func (s *Service) getPoints(w http.ResponseWriter, r *http.Request) {
	var points int64
	err := s.pool.QueryRow(r.Context(), `SELECT points FROM points WHERE customer_id = $1`, chi.URLParam(r, "customer")).Scan(&points)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]int64{"points": points})
}

// guide: end http

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
	reg := services.All
	if _, err := services.All.Get(Registration.Name); err != nil {
		loyalty := Registration
		// A real service keeps its SQL in migrations/loyalty/; this one
		// lives only in a test.
		loyalty.Migrations = fstest.MapFS{"00002_loyalty.sql": {Data: []byte(loyaltySQL)}}
		reg = append(append(registry.Registry{}, services.All...), loyalty)
	}
	shop := shoptest.StartFor(t, reg) // migrates every schema as each service starts
	op := operator.Shop{Services: reg}
	getenv := func(k string) string { return shop.Env[k] }
	ctx := t.Context()

	// `shop migrate loyalty` applies its schema again: nothing pending.
	if err := op.Migrate(ctx, []string{"loyalty"}, getenv, io.Discard, io.Discard); err != nil {
		t.Fatalf("shop migrate loyalty: %v", err)
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
	err := op.Verify(ctx, []string{"-wait", "30s"}, getenv, &report, io.Discard)
	if err != nil {
		t.Fatalf("shop verify: %v\n%s", err, report.String())
	}
	for _, want := range []string{
		"loyalty: each award has exactly one PointsAwarded",
		"loyalty: each customer's points are the sum of their awards",
		"loyalty-orders processed every order event",
		"loyalty: stream LOYALTY holds every event marked published",
	} {
		if !strings.Contains(report.String(), "ok   invariant") || !strings.Contains(report.String(), want) {
			t.Errorf("shop verify does not report %q:\n%s", want, report.String())
		}
	}
}

// The guide's code blocks are this file's, between its "guide:" markers:
// what a forker copies from the guide is what this test runs.
func TestGuideQuotesTheFifthService(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("fifth_test.go")
	if err != nil {
		t.Fatal(err)
	}
	guide, err := os.ReadFile("../docs/adding-a-service.md")
	if err != nil {
		t.Fatal(err)
	}
	parts := regexp.MustCompile(`(?s)// guide: (\w+)\n(.*?)\n// guide: end \w+\n`).FindAllStringSubmatch(string(src), -1)
	if len(parts) < 5 {
		t.Fatalf("found %d guide parts in fifth_test.go, want the registration, migration, constructor, handler and http", len(parts))
	}
	for _, p := range parts {
		if !strings.Contains(string(guide), strings.TrimSpace(p[2])) {
			t.Errorf("docs/adding-a-service.md does not quote the %s of fifth_test.go as it is now; copy it again:\n%s", p[1], p[2])
		}
	}
}
