package app

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

// A shop started while JetStream cannot answer (a cluster without quorum
// yet, here a server with JetStream off) comes up by itself when it can:
// no crash loop. Meanwhile it serves HTTP and reports JetStream down.
func TestStartsBeforeJetStreamAnswers(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	ns.Stop()
	ns.StartWithoutJetStream()
	db := pgtest.NewDatabase(t, "shop_app_js_")
	addr := freeAddr(t)
	env := map[string]string{"DATABASE_URL": db.URL, "NATS_URL": ns.URL(), "INVENTORY_ADDR": addr}
	cfg, err := LoadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, []string{"inventory"}, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})

	wait, stopWaiting := context.WithTimeout(ctx, time.Minute)
	defer stopWaiting()
	if err := httpx.WaitReady(wait, nil, "http://"+addr); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, time.Minute, "readyz to report jetstream down", func() bool {
		return strings.Contains(get200(t, "http://"+addr+"/readyz"), `"jetstream":{"status":"down"`)
	})
	time.Sleep(3 * time.Second) // several rounds of retries: the process must still run
	select {
	case err := <-done:
		t.Fatalf("Run returned while JetStream was off: %v", err)
	default:
	}

	ns.Restart() // JetStream comes back with the server
	_, js := ns.Connect(t)
	poll.Until(t, time.Minute, "the streams and the durable consumer", func() bool {
		_, err := js.Consumer(ctx, "ORDERS", "inventory-orders")
		return err == nil
	})
	poll.Until(t, time.Minute, "readyz to report jetstream up", func() bool {
		return strings.Contains(get200(t, "http://"+addr+"/readyz"), `"jetstream":{"status":"up"`)
	})
}

// A stream deleted under a running shop is created again by the stream
// keeper, so the relay's events for it do not die of "no stream for the
// subject"; a service waits for its streams and creates none.
func TestKeeperRecreatesADeletedStream(t *testing.T) {
	t.Parallel()
	ns, _ := natstest.NewSecured(t, services.All.Access())
	_, admin := ns.Connect(t)
	_, keeperJS := ns.ConnectAs(t, broker.StreamsUser)
	_, orderJS := ns.ConnectAs(t, "order")
	cfg, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	// The order service: it owns ORDERS and reads PAYMENT.
	e, _ := cfg.Registry.Get("order")
	access := e.Access()
	s := &Service{Name: "order", Stream: access.Stream, Subjects: access.Subjects, access: access, cfg: cfg, Logger: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	short, stop := context.WithTimeout(ctx, time.Second)
	defer stop()
	if s.waitForStreams(short, orderJS) {
		t.Fatal("the order service found its streams before any keeper created them")
	}
	if _, err := admin.Stream(ctx, "ORDERS"); err == nil {
		t.Fatal("ORDERS exists: the order service created it")
	}
	go newStreamKeeper(keeperJS, shopStreams(cfg), slog.New(slog.DiscardHandler)).run(ctx, 50*time.Millisecond)
	if !s.waitForStreams(ctx, orderJS) {
		t.Fatal("the order service did not find its streams")
	}
	if err := admin.DeleteStream(ctx, "PAYMENT"); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, time.Minute, "PAYMENT to exist again", func() bool {
		_, err := admin.Stream(ctx, "PAYMENT")
		return err == nil
	})
}

// The windows rule, checked against the real relay configuration and the
// streams as they are: retry horizon < duplicate window < inbox retention.
func TestCheckWindows(t *testing.T) {
	t.Parallel()
	horizon := relayConfig().RetryHorizon()
	if horizon >= broker.DuplicateWindow {
		t.Fatalf("the relay's retry horizon %s is not shorter than broker.DuplicateWindow %s", horizon, broker.DuplicateWindow)
	}
	all := map[string]time.Duration{}
	for _, a := range services.All.Access() {
		all[a.Stream] = broker.DuplicateWindow
	}
	if err := checkWindows(horizon, all, consumersOnly{}); err != nil {
		t.Fatalf("the shipped configuration breaks the rule: %v", err)
	}
	short := map[string]time.Duration{"ORDERS": horizon}
	if err := checkWindows(horizon, short, consumersOnly{}); err == nil || !strings.Contains(err.Error(), "ORDERS") ||
		!strings.Contains(err.Error(), horizon.String()) {
		t.Fatalf("a window no longer than the retry horizon: %v, want an error naming both", err)
	}

	ns := natstest.New(t)
	_, js := ns.Connect(t)
	c, err := inbox.NewConsumer(pgtest.New(t).Pool, js, inbox.Config{Name: "c", Stream: "ORDERS",
		Handler: func(context.Context, pgx.Tx, []inbox.Batched) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	dom := consumersOnly{c}
	long := map[string]time.Duration{"ORDERS": registry.InboxRetention}
	if err := checkWindows(time.Minute, long, dom); err == nil || !strings.Contains(err.Error(), "inbox retention ("+registry.InboxRetention.String()+")") {
		t.Fatalf("a window longer than the inbox retention: %v, want an error naming the three values", err)
	}
}

// consumersOnly is a domain of consumers and nothing else.
type consumersOnly []*inbox.Consumer

func (c consumersOnly) Consumers() []*inbox.Consumer { return c }
func (consumersOnly) Run(context.Context) error      { return nil }
func (consumersOnly) Routes(chi.Router)              {}

func get200(t *testing.T, url string) string {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		return ""
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return string(b)
}

// A service started while Postgres does not answer waits for it instead of
// exiting (here nothing listens on its database's port at first; then a
// forwarder to the real server appears there).
func TestStartsBeforeThePostgresAnswers(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	db := pgtest.NewDatabase(t, "shop_app_pg_")
	real, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	dbAddr := freeAddr(t) // nothing there yet: connection refused
	late := *real
	late.Host = dbAddr
	addr := freeAddr(t)
	env := map[string]string{"DATABASE_URL": late.String(), "NATS_URL": ns.URL(), "INVENTORY_ADDR": addr}
	cfg, err := LoadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, []string{"inventory"}, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	time.Sleep(2 * time.Second) // several tries: the process must still run
	select {
	case err := <-done:
		t.Fatalf("Run returned while Postgres did not answer: %v", err)
	default:
	}

	ln, err := net.Listen("tcp", dbAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go forward(ln, real.Host)
	wait, stopWaiting := context.WithTimeout(ctx, time.Minute)
	defer stopWaiting()
	if err := httpx.WaitReady(wait, nil, "http://"+addr); err != nil {
		t.Fatal(err)
	}
}

// forward copies every connection accepted on ln to and from target.
func forward(ln net.Listener, target string) { silenceable(ln, target, new(atomic.Bool)) }

// The streams must keep a message as long as anything may still look for
// it: the stream audit (the outbox's retention) and a consumer's replay.
func TestCheckLimits(t *testing.T) {
	t.Parallel()
	all := map[string]jetstream.StreamConfig{}
	for _, a := range services.All.Access() {
		all[a.Stream] = jetstream.StreamConfig{Name: a.Stream, MaxAge: broker.DefaultLimits.MaxAge}
	}
	if err := checkLimits(all, consumersOnly{}); err != nil {
		t.Fatalf("the shipped limits break the rule: %v", err)
	}
	if err := checkLimits(map[string]jetstream.StreamConfig{"ORDERS": {MaxAge: 0}}, consumersOnly{}); err != nil {
		t.Fatalf("no max age (kept for ever): %v", err)
	}
	if err := checkLimits(map[string]jetstream.StreamConfig{"ORDERS": {MaxAge: time.Hour}}, consumersOnly{}); err == nil ||
		!strings.Contains(err.Error(), "NATS_STREAM_MAX_AGE") {
		t.Fatalf("a max age under the outbox retention: %v, want an error saying what to raise", err)
	}
	ns := natstest.New(t)
	_, js := ns.Connect(t)
	c, err := inbox.NewConsumer(pgtest.New(t).Pool, js, inbox.Config{Name: "c", Stream: "ORDERS",
		Handler: func(context.Context, pgx.Tx, []inbox.Batched) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	short := map[string]jetstream.StreamConfig{"ORDERS": {MaxAge: 4 * 24 * time.Hour}} // above the outbox's 72h, under the 7-day replay window
	if err := checkLimits(short, consumersOnly{c}); err == nil || !strings.Contains(err.Error(), "replay window") {
		t.Fatalf("a max age under a consumer's replay window: %v", err)
	}
}

// A silent partition (the network drops everything, nothing is reset) is
// noticed by the connection's pings within seconds, and the connection is
// replaced when the server answers again: the shop stalled about 30 s on
// one with pings every 10 s.
func TestSilentPartitionIsNoticedInSeconds(t *testing.T) {
	t.Parallel()
	if d := time.Duration(MaxPingsOut+1) * PingInterval; d > 5*time.Second {
		t.Fatalf("a silent partition would go unnoticed for up to %v; want at most 5s", d)
	}
	ns := natstest.New(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var silent atomic.Bool
	go silenceable(ln, strings.TrimPrefix(ns.URL(), "nats://"), &silent)
	nc, err := connectNATS("nats://"+ln.Addr().String(), "order", "unused", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	poll.Until(t, time.Minute, "connected", func() bool { return nc.IsConnected() })

	silent.Store(true)
	start := time.Now()
	// Bounded generously for a loaded machine; the figure is logged.
	poll.Until(t, 15*time.Second, "the client to notice a silent partition", func() bool { return !nc.IsConnected() })
	t.Logf("silent partition noticed after %v", time.Since(start).Round(time.Millisecond))
	silent.Store(false)
	poll.Until(t, time.Minute, "reconnected once the network answers", func() bool { return nc.IsConnected() })
}

// silenceable forwards every connection accepted on ln to target; while
// silent is set it forwards nothing and closes nothing, as a partition
// that drops packets does.
func silenceable(ln net.Listener, target string, silent *atomic.Bool) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			up, err := net.Dial("tcp", target)
			if err != nil {
				return
			}
			defer up.Close()
			pipe := func(dst, src net.Conn) {
				buf := make([]byte, 32<<10)
				for {
					n, err := src.Read(buf)
					if err != nil {
						return
					}
					if !silent.Load() {
						if _, err := dst.Write(buf[:n]); err != nil {
							return
						}
					}
				}
			}
			go pipe(up, c)
			pipe(c, up)
		}()
	}
}
