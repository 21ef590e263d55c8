package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/proof/shoptest"
	"github.com/shop-ref/shop/services"
)

func TestAll(t *testing.T) {
	t.Parallel()
	dbURL := shoptest.NewDatabaseURL(t)
	ns := natstest.New(t)
	vars := map[string]string{"DATABASE_URL": dbURL, "NATS_URL": ns.URL(), "DASHBOARD_ADDR": shoptest.FreeAddr(t)}
	addrs := map[string]string{}
	// Every service of the registry on a free port: one left at its
	// default would collide with another shop of the suite.
	for _, name := range services.All.Names() {
		addrs[name] = shoptest.FreeAddr(t)
		vars[strings.ToUpper(name)+"_ADDR"] = addrs[name]
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"all"}, env(vars), io.Discard, io.Discard) }()

	for name, addr := range addrs {
		poll.Until(t, 30*time.Second, name+" ready", func() bool {
			select {
			case err := <-done:
				t.Fatalf("shop all returned before it was ready: %v", err)
			default:
			}
			resp, err := http.Get("http://" + addr + "/readyz")
			if err != nil {
				return false
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK
		})
	}

	_, js := ns.Connect(t)
	for _, e := range services.All {
		stream := e.Stream
		poll.Until(t, 10*time.Second, "stream "+stream, func() bool {
			_, err := js.Stream(ctx, stream)
			return err == nil
		})
	}

	t.Run("the order relay publishes a committed event", func(t *testing.T) {
		pool, err := database.NewPool(ctx, dbURL, "orders", 2)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		var w outbox.Writer
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return w.Add(ctx, tx, outbox.Event{
				AggregateType: "order", AggregateID: "o-1", Type: "OrderCreated",
				Subject: "orders.o-1.OrderCreated", Payload: map[string]string{"order_id": "o-1"},
			})
		})
		if err != nil {
			t.Fatal(err)
		}
		stream, err := js.Stream(ctx, "ORDERS")
		if err != nil {
			t.Fatal(err)
		}
		poll.Until(t, 15*time.Second, "the event on ORDERS", func() bool {
			msg, err := stream.GetLastMsgForSubject(ctx, "orders.o-1.OrderCreated")
			return err == nil && msg.Header.Get("Event-Type") == "OrderCreated"
		})
	})

	t.Run("the dashboard takes no orders outside the demo", func(t *testing.T) {
		base := "http://" + vars["DASHBOARD_ADDR"]
		var st struct {
			CanOrder *bool `json:"can_order"`
		}
		poll.Until(t, 30*time.Second, "the dashboard's state", func() bool {
			res, err := http.Get(base + "/api/state")
			if err != nil {
				return false
			}
			defer res.Body.Close()
			return res.StatusCode == http.StatusOK && json.NewDecoder(res.Body).Decode(&st) == nil
		})
		if st.CanOrder == nil || *st.CanOrder {
			t.Errorf("state: can_order %v, want false", st.CanOrder)
		}
		for _, path := range []string{"/api/demo/order", "/api/demo/pay/0193b5f0-0000-7000-8000-000000000001"} {
			res, err := http.Post(base+path, "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Fatal(err)
			}
			res.Body.Close()
			if res.StatusCode != http.StatusNotFound && res.StatusCode != http.StatusMethodNotAllowed {
				t.Errorf("POST %s: %s, want 404 or 405", path, res.Status)
			}
		}
	})

	t.Run("stops cleanly when the context ends", func(t *testing.T) {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("run returned %v, want nil after a clean shutdown", err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("run did not return within 20s of cancel")
		}
		for name, addr := range addrs {
			if resp, err := http.Get("http://" + addr + "/healthz"); err == nil {
				resp.Body.Close()
				t.Errorf("%s still answers on %s after shutdown", name, addr)
			}
		}
	})
}

func TestAllDemo(t *testing.T) {
	t.Parallel()
	// Port 0: each listener takes a free port as it binds, so no other
	// process can take it between a test's choice and the bind.
	demoVars := func(t *testing.T) map[string]string {
		vars := map[string]string{"DATABASE_URL": shoptest.NewDatabaseURL(t), "NATS_URL": natstest.New(t).URL(), "DASHBOARD_ADDR": "127.0.0.1:0"}
		for _, name := range services.All.Names() {
			vars[strings.ToUpper(name)+"_ADDR"] = "127.0.0.1:0"
		}
		return vars
	}

	t.Run("prints the dashboard address it really bound", func(t *testing.T) {
		t.Parallel()
		vars := demoVars(t)
		taken, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer taken.Close()
		vars["DASHBOARD_ADDR"] = taken.Addr().String()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var out logbuf.Buffer
		done := make(chan error, 1)
		go func() { done <- run(ctx, []string{"all", "-demo"}, env(vars), &out, io.Discard) }()
		poll.Until(t, time.Minute, "the demo banner", func() bool {
			select {
			case err := <-done:
				t.Fatalf("shop all -demo returned: %v", err)
			default:
			}
			return strings.Contains(out.String(), "The demo shop is up")
		})
		_, after, ok := strings.Cut(out.String(), "dashboard: ")
		dashboard := strings.TrimSpace(strings.SplitN(after, "\n", 2)[0])
		if !ok || dashboard == "http://"+vars["DASHBOARD_ADDR"] {
			t.Fatalf("banner names dashboard %q, which another listener holds:\n%s", dashboard, out.String())
		}
		res, err := http.Get(dashboard + "/api/state")
		if err != nil {
			t.Fatalf("the dashboard the banner names: %v", err)
		}
		var st struct {
			CanOrder bool `json:"can_order"`
		}
		err = json.NewDecoder(res.Body).Decode(&st)
		res.Body.Close()
		if res.StatusCode != http.StatusOK || err != nil {
			t.Fatalf("the dashboard the banner names answers %s (%v)", res.Status, err)
		}
		if !st.CanOrder {
			t.Error("the demo's dashboard says it may not place orders")
		}
		conn, err := pgx.Connect(ctx, vars["DATABASE_URL"])
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var onHand int
		if err := conn.QueryRow(ctx, `SELECT on_hand FROM inventory.stock WHERE sku = 'SKU-1'`).Scan(&onHand); err != nil || onHand == 0 {
			t.Fatalf("SKU-1 not stocked by the demo: %d, %v", onHand, err)
		}
	})

	t.Run("stops before seeding when a listener cannot bind", func(t *testing.T) {
		t.Parallel()
		vars := demoVars(t)
		// Another process holds the inventory address and answers every
		// request, as an older shop left running would.
		var requests sync.Map
		other := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			requests.Store(r.Method+" "+r.URL.Path, true)
			w.WriteHeader(http.StatusOK)
		})}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		vars["INVENTORY_ADDR"] = ln.Addr().String()
		go func() { _ = other.Serve(ln) }()
		defer other.Close()

		var out logbuf.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = run(ctx, []string{"all", "-demo"}, env(vars), &out, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "listen") || !strings.Contains(err.Error(), vars["INVENTORY_ADDR"]) {
			t.Fatalf("run returned %v, want the inventory service's listen error", err)
		}
		if strings.Contains(out.String(), "The demo shop is up") {
			t.Errorf("printed the banner although inventory could not listen:\n%s", out.String())
		}
		requests.Range(func(k, _ any) bool {
			t.Errorf("the demo sent %v to the other process on the inventory address", k)
			return true
		})
	})
}

// `shop dashboard` serves the dashboard alone, as Compose runs it: it reads
// the services' schemas and, with DASHBOARD_DEMO as Compose sets it, places
// an order through ORDER_URL.
func TestDashboard(t *testing.T) {
	t.Parallel()
	s := shoptest.StartFor(t, services.All)
	s.Restock(t, "SKU-1", 10, 100)
	vars := map[string]string{"DASHBOARD_ADDR": shoptest.FreeAddr(t), "ORDER_URL": s.URLs["order"], "PAYMENT_URL": s.URLs["payment"],
		"DASHBOARD_DEMO": "true"}
	for k, v := range s.Env {
		if strings.HasSuffix(k, "DATABASE_URL") {
			vars[k] = v
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"dashboard"}, env(vars), io.Discard, io.Discard) }()
	base := "http://" + vars["DASHBOARD_ADDR"]
	var placed struct {
		OrderID string `json:"order_id"`
	}
	poll.Until(t, 30*time.Second, "the dashboard places an order", func() bool {
		select {
		case err := <-done:
			t.Fatalf("shop dashboard returned: %v", err)
		default:
		}
		res, err := http.Post(base+"/api/demo/order", "application/json", nil)
		if err != nil {
			return false
		}
		defer res.Body.Close()
		return res.StatusCode == http.StatusCreated && json.NewDecoder(res.Body).Decode(&placed) == nil && placed.OrderID != ""
	})
	poll.Until(t, 30*time.Second, "the order on the dashboard", func() bool {
		res, err := http.Get(base + "/api/state")
		if err != nil {
			return false
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode == http.StatusOK && strings.Contains(string(b), placed.OrderID)
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("shop dashboard: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Error("shop dashboard did not stop within 20s of cancel")
	}
}
