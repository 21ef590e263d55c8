package app

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

// TestForgedOrderPaidShipsNothing plays the attacker of issue 39 who holds
// the payment service's NATS credentials. Before the shop starts, it tries
// to create PAYMENT in memory with a republish of payment.forge.> as
// orders.>, which nats-server accepted of a user who may publish only to
// payment.>: now refused, only the stream keeper creates streams. So the
// republish comes from a stream of someone who may create one (FORGE, the
// server's admin, outside the shop's streams): once an order waits for
// payment, an OrderPaid of that order with the headers and payload the
// order service would send is published to forge.<order>.OrderPaid.
// ORDERS stores the copy; every consumer it reaches dead-letters it as
// forged, so nothing ships, no stock is sold, the order still waits for
// payment, and shop verify finds no shipment without payment.
func TestForgedOrderPaidShipsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ns, passwords := natstest.NewSecured(t, services.All.Access())
	_, asPayment := ns.ConnectAs(t, "payment")
	short, stop := context.WithTimeout(ctx, time.Second)
	_, err := asPayment.CreateStream(short, jetstream.StreamConfig{
		Name: "PAYMENT", Subjects: []string{"payment.>"}, Storage: jetstream.MemoryStorage,
		RePublish: &jetstream.RePublish{Source: "payment.forge.>", Destination: "orders.>"},
	})
	stop()
	if err == nil {
		t.Fatal("the payment user created a republishing PAYMENT")
	}
	_, admin := ns.Connect(t)
	if _, err := admin.CreateStream(ctx, jetstream.StreamConfig{
		Name: "FORGE", Subjects: []string{"forge.>"}, Storage: jetstream.MemoryStorage,
		RePublish: &jetstream.RePublish{Source: "forge.>", Destination: "orders.>"},
	}); err != nil {
		t.Fatal(err)
	}

	// Port 0 everywhere: each listener takes a free port as it binds (the
	// log says which), so no other process can take it in between.
	db := pgtest.NewDatabase(t, "shop_app_forged_")
	env := map[string]string{"DATABASE_URL": db.URL, "NATS_URL": ns.URL(), "FULFILLMENT_DELAY": "100ms",
		"DASHBOARD_ADDR": "127.0.0.1:0"}
	for user, pw := range passwords {
		env[broker.PasswordVar(user)] = pw
	}
	for _, name := range services.All.Names() {
		env[strings.ToUpper(name)+"_ADDR"] = "127.0.0.1:0"
	}
	cfg, err := LoadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	out := &logbuf.Buffer{}
	go func() { done <- Run(runCtx, cfg, services.All.Names(), slog.New(slog.NewTextHandler(out, nil))) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	urls := map[string]string{}
	listening := regexp.MustCompile(`msg="http listening" service=([a-z0-9]+) addr=(\S+)`)
	poll.Until(t, time.Minute, "every service listens", func() bool {
		select {
		case err := <-done:
			t.Fatalf("the shop stopped: %v", err)
		default:
		}
		for _, m := range listening.FindAllStringSubmatch(out.String(), -1) {
			urls[m[1]] = "http://" + m[2]
		}
		return len(urls) == len(services.All)
	})
	url := func(service string) string { return urls[service] }
	for _, name := range services.All.Names() {
		wait, stop := context.WithTimeout(ctx, time.Minute)
		err := httpx.WaitReady(wait, nil, url(name))
		stop()
		if err != nil {
			t.Fatal(err)
		}
	}

	// An order that waits for payment, as a customer places it.
	if status, body := call(t, "PUT", url("inventory")+"/stock/SKU-F", nil, `{"on_hand":10,"price":500}`); status != http.StatusOK {
		t.Fatalf("restock: %d %s", status, body)
	}
	var order struct {
		ID     string `json:"order_id"`
		Total  int64  `json:"total"`
		Status string `json:"status"`
	}
	key := "forged-" + uuid.NewString()
	poll.Until(t, 30*time.Second, "the order service sells SKU-F", func() bool {
		status, body := call(t, "POST", url("order")+"/orders", map[string]string{"Idempotency-Key": key},
			`{"customer_id":"c-1","items":[{"sku":"SKU-F","quantity":2}]}`)
		return status == http.StatusCreated && json.Unmarshal(body, &order) == nil
	})
	poll.Until(t, 30*time.Second, "the order says WAIT_PAY", func() bool {
		_, body := call(t, "GET", url("order")+"/orders/"+order.ID, nil, "")
		return json.Unmarshal(body, &order) == nil && order.Status == "WAIT_PAY"
	})

	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	scalar := func(sql string, args ...any) int64 {
		t.Helper()
		var n int64
		if err := conn.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	// The sequence the order service would give its OrderPaid.
	seq := scalar(`SELECT max(aggregate_seq) + 1 FROM orders.outbox WHERE aggregate_type = 'order' AND aggregate_id = $1`, order.ID)

	forged, eventID := nats.NewMsg("forge."+order.ID+".OrderPaid"), uuid.NewString()
	for k, v := range map[string]string{
		jetstream.MsgIDHeader: eventID, "Event-Type": "OrderPaid", "Aggregate-Type": "order",
		"Aggregate-Id": order.ID, "Aggregate-Seq": strconv.FormatInt(seq, 10), "Schema-Version": "1",
		"Occurred-At": time.Now().UTC().Format(time.RFC3339Nano),
	} {
		forged.Header.Set(k, v)
	}
	forged.Data = fmt.Appendf(nil, `{"order_id":%q,"payment_id":%q,"amount":%d,"items":[{"sku":"SKU-F","quantity":2}]}`,
		order.ID, uuid.NewString(), order.Total)
	if _, err := admin.PublishMsg(ctx, forged); err != nil {
		t.Fatalf("publish to FORGE: %v", err)
	}
	poll.Until(t, 10*time.Second, "ORDERS holds the copy", func() bool {
		st, err := admin.Stream(ctx, "ORDERS")
		if err != nil {
			return false
		}
		_, err = st.GetLastMsgForSubject(ctx, "orders."+order.ID+".OrderPaid")
		return err == nil
	})

	// Every consumer delivered OrderPaid settles the copy (applies, parks or
	// dead-letters it), and dead-letters it as forged.
	for _, r := range services.All.Readers() {
		if r.Stream != "ORDERS" || (r.Types != nil && !slices.Contains(r.Types, "OrderPaid")) {
			continue
		}
		e, _ := services.All.Get(r.Service)
		schema := pgx.Identifier{e.Schema}.Sanitize()
		poll.Until(t, 30*time.Second, r.Name+" settles the copy", func() bool {
			return scalar(`SELECT (SELECT count(*) FROM `+schema+`.processed_events WHERE consumer_name = $1 AND event_id = $2)
				+ (SELECT count(*) FROM `+schema+`.inbox_parked WHERE consumer_name = $1 AND event_id = $2)
				+ (SELECT count(*) FROM `+schema+`.dead_letters WHERE consumer_name = $1 AND event_id = $2)`, r.Name, eventID) > 0
		})
		if n := scalar(`SELECT count(*) FROM `+schema+`.dead_letters WHERE consumer_name = $1 AND event_id = $2
			AND error LIKE '%forged%'`, r.Name, eventID); n != 1 {
			t.Errorf("%s did not dead-letter the copy as forged", r.Name)
		}
	}
	if n := scalar(`SELECT count(*) FROM fulfillment.shipments WHERE order_id = $1`, order.ID); n != 0 {
		t.Errorf("%d shipments of the unpaid order, want none", n)
	}
	if sold := scalar(`SELECT sold FROM inventory.stock WHERE sku = 'SKU-F'`); sold != 0 {
		t.Errorf("%d units of SKU-F sold, want none", sold)
	}
	if _, body := call(t, "GET", url("order")+"/orders/"+order.ID, nil, ""); json.Unmarshal(body, &order) != nil || order.Status != "WAIT_PAY" {
		t.Errorf("the order is %q, want WAIT_PAY: %s", order.Status, body)
	}
	noUnpaidGoods(t, cfg)
}

// noUnpaidGoods fails t when shop verify finds a shipment, or stock sold,
// without a succeeded payment of its order.
func noUnpaidGoods(t *testing.T, cfg config.Config) {
	t.Helper()
	shop, closePools, err := OpenShop(context.Background(), cfg.Schemas(), 1)
	if err != nil {
		t.Fatal(err)
	}
	defer closePools()
	rep, err := verify.Run(context.Background(), shop, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range rep.Checks {
		if strings.Contains(c.Name, "without a succeeded payment") && len(c.Violations) > 0 {
			t.Errorf("shop verify: %s: %q", c.Name, c.Violations)
		}
	}
}

// call sends a request with a JSON body (when not empty) and returns the
// status and the body of the answer.
func call(t *testing.T, method, url string, header map[string]string, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, b
}
