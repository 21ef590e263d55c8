package dashboard

import (
	"cmp"
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// States are the saga states an order moves through, in the order the page
// shows them as columns.
var States = []string{"PENDING", "WAIT_PAY", "PAID", "FULFILLING", "COMPLETED", "REJECTED", "CLOSED"}

// How much of each list the state carries.
const (
	recentOrders = 20
	recentEvents = 20
)

// State is what the page shows, as GET /api/state and every server-sent
// event carry it.
type State struct {
	At             time.Time      `json:"at"`
	PaymentTimeout string         `json:"payment_timeout"` // PAYMENT_TIMEOUT, such as "15m0s"
	CanOrder       bool           `json:"can_order"`       // the page may place orders (Config.Demo)
	CanPay         bool           `json:"can_pay"`         // the page may offer Pay (Config.Demo and Config.CanPay)
	Currency       string         `json:"currency"`        // the unit of every total: Currency
	Counts         map[string]int `json:"counts"`          // orders per saga state; every state present
	Orders         []Order        `json:"orders"`          // the most recently updated, newest first
	Outbox         []Backlog      `json:"outbox"`          // one per service
	Events         []Event        `json:"events"`          // the most recently published, newest first
	DeadLetters    []DeadLetters  `json:"dead_letters"`    // one per service
	Health         []Health       `json:"health"`          // one per service of Config.ServiceURLs, once Run has asked
}

// Currency is the unit of the shop's totals. The API carries money as an
// integer number of cents with no currency field (api/openapi.yaml); the one
// currency the shop trades in is inventory's DefaultCurrency, which an
// OrderCreated without a currency field is in. The page prints totals in it
// so that "12990" reads as €129.90, not as a bare number.
const Currency = "EUR"

// Order is one order as the order schema holds it: orders.orders, its
// order_items, and for a CLOSED or REJECTED order the reason order_history
// gives for that state.
type Order struct {
	ID         string    `json:"order_id"`
	Status     string    `json:"status"`
	Total      int64     `json:"total"` // cents of Currency, as the API's totals
	UpdatedAt  time.Time `json:"updated_at"`
	CustomerID string    `json:"customer_id"`
	Items      []Item    `json:"items"`
	// Reason is why the order ended CLOSED or REJECTED (order_history's
	// reason, such as "payment_timeout"); "" in the other states.
	Reason string `json:"reason"`
	// TraceURL opens the order's trace in the trace UI of
	// Config.TraceUIURL; "" when none is configured or the order's first
	// event carries no trace context.
	TraceURL string `json:"trace_url,omitempty"`
	// traceparent is the W3C trace context the order's first outbox row
	// keeps in its headers (pkg/outbox writes the writer's there).
	traceparent string
}

// Item is one line of an order.
type Item struct {
	SKU       string `json:"sku"`
	Quantity  int    `json:"quantity"`
	UnitPrice int64  `json:"unit_price"` // cents
}

// Backlog is one service's outbox, from outbox.ReadStats.
type Backlog struct {
	Service       string  `json:"service"`
	Pending       int64   `json:"pending"`
	OldestPending float64 `json:"oldest_pending_seconds"` // 0 when nothing is pending
	Dead          int64   `json:"dead"`
}

// Event is one published outbox row.
type Event struct {
	Service     string    `json:"service"`
	Subject     string    `json:"subject"`
	Type        string    `json:"type"`
	PublishedAt time.Time `json:"published_at"`
}

// DeadLetters counts what one service's consumers could not apply: open
// (unresolved) dead letters, the conflicts among them, and the events parked
// until an earlier event of their aggregate comes, with the oldest's age.
type DeadLetters struct {
	Service      string  `json:"service"`
	Open         int64   `json:"open"`
	Conflicts    int64   `json:"conflicts"`
	Parked       int64   `json:"parked"`
	OldestParked float64 `json:"oldest_parked_seconds"`
}

// readState reads the state from every service's schema. Each query is
// small: the outbox ones use its partial indexes, and the two over
// orders.orders scan a table that, in a demo, stays small.
func (s *Server) readState(ctx context.Context) (State, error) {
	st := State{
		At:             time.Now().UTC(),
		PaymentTimeout: s.cfg.PaymentTimeout.String(),
		CanOrder:       s.cfg.Demo,
		CanPay:         s.cfg.Demo && s.cfg.CanPay,
		Currency:       Currency,
		Counts:         make(map[string]int, len(States)),
		Orders:         []Order{},
		Events:         []Event{},
	}
	for _, state := range States {
		st.Counts[state] = 0
	}
	orders := s.cfg.Pools["order"]
	rows, err := orders.Query(ctx, `SELECT status, count(*) FROM orders GROUP BY status`)
	if err != nil {
		return State{}, fmt.Errorf("count orders: %w", err)
	}
	var (
		status string
		n      int
	)
	if _, err := pgx.ForEachRow(rows, []any{&status, &n}, func() error { st.Counts[status] = n; return nil }); err != nil {
		return State{}, fmt.Errorf("count orders: %w", err)
	}
	// The items and the reason are read per listed order through their
	// indexes (order_items' key, order_history_order), 20 orders at most.
	rows, err = orders.Query(ctx, `SELECT o.order_id::text, o.status, o.total, o.updated_at, o.customer_id,
			coalesce((SELECT json_agg(json_build_object('sku', i.sku, 'quantity', i.quantity, 'unit_price', i.unit_price)
				ORDER BY i.line) FROM order_items i WHERE i.order_id = o.order_id), '[]'),
			CASE WHEN o.status IN ('CLOSED', 'REJECTED') THEN coalesce((SELECT h.reason FROM order_history h
				WHERE h.order_id = o.order_id AND h.status = o.status ORDER BY h.id DESC LIMIT 1), '') ELSE '' END,
			coalesce((SELECT x.headers->>'traceparent' FROM outbox x WHERE x.aggregate_type = 'order'
				AND x.aggregate_id = o.order_id::text ORDER BY x.aggregate_seq LIMIT 1), '')
		FROM orders o ORDER BY o.updated_at DESC, o.order_id LIMIT $1`, recentOrders)
	if err != nil {
		return State{}, fmt.Errorf("list orders: %w", err)
	}
	st.Orders, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (Order, error) {
		var o Order
		err := r.Scan(&o.ID, &o.Status, &o.Total, &o.UpdatedAt, &o.CustomerID, &o.Items, &o.Reason, &o.traceparent)
		return o, err
	})
	if err != nil {
		return State{}, fmt.Errorf("list orders: %w", err)
	}
	for i := range st.Orders {
		st.Orders[i].TraceURL = traceURL(s.cfg.TraceUIURL, st.Orders[i].traceparent)
	}

	for _, name := range s.services {
		db := s.cfg.Pools[name]
		stats, err := outbox.ReadStats(ctx, db)
		if err != nil {
			return State{}, fmt.Errorf("%s: %w", name, err)
		}
		st.Outbox = append(st.Outbox, Backlog{
			Service: name, Pending: stats.Pending, Dead: stats.Dead,
			OldestPending: stats.OldestPending.Seconds(),
		})
		// outbox_published indexes published_at, so this reads 20 index
		// entries however long the retention.
		rows, err := db.Query(ctx, `SELECT $1::text, subject, event_type, published_at FROM outbox
			WHERE published_at IS NOT NULL ORDER BY published_at DESC LIMIT $2`, name, recentEvents)
		if err != nil {
			return State{}, fmt.Errorf("%s: latest events: %w", name, err)
		}
		events, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Event])
		if err != nil {
			return State{}, fmt.Errorf("%s: latest events: %w", name, err)
		}
		st.Events = append(st.Events, events...)

		// dead_letters_open is a partial index of exactly these rows.
		dl := DeadLetters{Service: name}
		if err := db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE conflict_with IS NOT NULL)
			FROM dead_letters WHERE resolved_at IS NULL`).Scan(&dl.Open, &dl.Conflicts); err != nil {
			return State{}, fmt.Errorf("%s: count dead letters: %w", name, err)
		}
		parked, oldest, err := inbox.ParkedStats(ctx, db, "")
		if err != nil {
			return State{}, fmt.Errorf("%s: %w", name, err)
		}
		dl.Parked = parked
		if !oldest.IsZero() {
			dl.OldestParked = time.Since(oldest).Seconds()
		}
		st.DeadLetters = append(st.DeadLetters, dl)
	}
	s.seriesMu.Lock()
	st.Health = append([]Health{}, s.health...)
	s.seriesMu.Unlock()
	slices.SortStableFunc(st.Events, func(a, b Event) int { return b.PublishedAt.Compare(a.PublishedAt) })
	st.Events = st.Events[:min(len(st.Events), recentEvents)]
	return st, nil
}

// traceURL is template with the trace id of traceparent in place of
// {trace_id}, or "" when either is missing or the traceparent is not a
// valid W3C one ("00-<32 hex trace id>-<16 hex span id>-<2 hex flags>").
func traceURL(template, traceparent string) string {
	parts := strings.Split(traceparent, "-")
	if template == "" || len(parts) != 4 || len(parts[1]) != 32 {
		return ""
	}
	id := strings.ToLower(parts[1])
	if _, err := hex.DecodeString(id); err != nil || id == strings.Repeat("0", 32) {
		return "" // the all-zero id is invalid: no trace was recorded
	}
	return strings.ReplaceAll(template, "{trace_id}", id)
}

// serviceNames returns the services of pools in a fixed order: the given
// order first, then any others by name.
func serviceNames[V any](pools map[string]V, order []string) []string {
	names := make([]string, 0, len(pools))
	for _, n := range order {
		if _, ok := pools[n]; ok {
			names = append(names, n)
		}
	}
	var rest []string
	for n := range pools {
		if !slices.Contains(order, n) {
			rest = append(rest, n)
		}
	}
	slices.SortFunc(rest, cmp.Compare)
	return append(names, rest...)
}
