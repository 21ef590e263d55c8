package app

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

// authConfServer starts a nats-server on a free loopback port whose users
// are deploy/nats/auth.conf's, with passwords, and an empty JetStream
// store. It returns the server's URL and a function connecting as one of
// its users.
func authConfServer(t *testing.T, passwords map[string]string) (string, func(user string) jetstream.JetStream) {
	t.Helper()
	dir := t.TempDir()
	var conf strings.Builder
	fmt.Fprintf(&conf, "listen: 127.0.0.1:-1\njetstream { store_dir: %q }\n", filepath.Join(dir, "store"))
	// The file as it is, but for each password, which nats-server reads
	// from its environment ($ORDER_NATS_PASSWORD, …): a test running beside
	// others cannot set that, so the value takes the reference's place.
	text, err := os.ReadFile(filepath.Join(repoRoot, "deploy/nats/auth.conf"))
	if err != nil {
		t.Fatal(err)
	}
	auth := string(text)
	for user, pw := range passwords {
		ref := "password: $" + broker.PasswordVar(user) + "\n"
		if !strings.Contains(auth, ref) {
			t.Fatalf("deploy/nats/auth.conf has no %q", ref)
		}
		auth = strings.Replace(auth, ref, fmt.Sprintf("password: %q\n", pw), 1)
	}
	if err := os.WriteFile(filepath.Join(dir, "auth.conf"), []byte(auth), 0o600); err != nil {
		t.Fatal(err)
	}
	conf.WriteString("include ./auth.conf\n")
	path := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(path, []byte(conf.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatal(err)
	}
	opts.NoSigs, opts.NoLog = true, true
	if len(opts.Users) != len(passwords) {
		t.Fatalf("deploy/nats/auth.conf has %d users, the test gives passwords to %d", len(opts.Users), len(passwords))
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server not ready")
	}
	connect := func(user string) jetstream.JetStream {
		t.Helper()
		// The refusals are the test's to check, not the client's to print.
		quiet := nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})
		nc, err := nats.Connect(srv.ClientURL(), append(broker.UserOptions(user, passwords[user]), quiet)...)
		if err != nil {
			t.Fatalf("connect as %s: %v", user, err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		return js
	}
	return srv.ClientURL(), connect
}

// TestHostileStreamsBeforeStart plays issue 39's attacks on the streams,
// with the users of deploy/nats/auth.conf on an empty store.
//
// (a) A service's user creating a stream — PAYMENT in memory, republishing
// into orders.> — is refused, whichever service, whichever stream.
//
// (b) Someone who may create streams (here a holder of the keeper's own
// password) creates them first with settings no update can restore:
// FULFILLMENT and INVENTORY in memory keeping one message and dropping the
// oldest, each given a message by its owner; PAYMENT in memory with that
// republish, empty. The shop starts: the keeper deletes and remakes the
// empty PAYMENT; the services that use FULFILLMENT or INVENTORY are not
// ready and say which stream and field, the log says it at ERROR with the
// found and wanted values, the drift metric shows it, and nothing is
// published into those streams (a restock waits in the outbox). The repair
// path of docs/operating.md — delete the stream as the keeper's user, the
// keeper creates it again — makes the shop ready, and then nothing is lost:
// the restock reaches the order service, every paid order completes, and
// shop verify finds every invariant holding, no shipment without payment.
func TestHostileStreamsBeforeStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// The shop deploy/nats/auth.conf was generated for: the guide's example
	// service (a build with -tags fifthservice) has no user there.
	shop := services.Deployed()
	passwords := map[string]string{}
	for _, user := range append(shop.Names(), broker.SystemUsers()...) {
		passwords[user] = rand.Text()
	}
	natsURL, connect := authConfServer(t, passwords)

	// (a)
	hostile := func(name string) jetstream.StreamConfig {
		return jetstream.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name) + ".>"}, Storage: jetstream.MemoryStorage,
			MaxMsgs: 1, Discard: jetstream.DiscardOld}
	}
	payment := hostile("PAYMENT")
	payment.MaxMsgs, payment.Discard = 0, 0
	payment.RePublish = &jetstream.RePublish{Source: "payment.forge.>", Destination: "orders.>"}
	for _, user := range shop.Names() {
		js := connect(user)
		for _, c := range []jetstream.StreamConfig{payment, hostile("FULFILLMENT")} {
			short, stop := context.WithTimeout(ctx, time.Second)
			_, err := js.CreateStream(short, c)
			stop()
			if err == nil {
				t.Fatalf("user %s created stream %s", user, c.Name)
			}
		}
	}
	keeper := connect(broker.StreamsUser)
	if names := streamNames(t, keeper); len(names) != 0 {
		t.Fatalf("streams %v exist after the services' users tried", names)
	}

	// (b)
	for _, c := range []jetstream.StreamConfig{payment, hostile("FULFILLMENT"), hostile("INVENTORY")} {
		if _, err := keeper.CreateStream(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	for _, user := range []string{"fulfillment", "inventory"} {
		if _, err := connect(user).Publish(ctx, user+".probe.Junk", nil); err != nil {
			t.Fatal(err)
		}
	}

	db := pgtest.NewDatabase(t, "shop_app_hostile_streams_")
	env := map[string]string{"DATABASE_URL": db.URL, "NATS_URL": natsURL, "FULFILLMENT_DELAY": "100ms",
		"DASHBOARD_ADDR": "127.0.0.1:0", "PAYMENT_FAKE_PROVIDER": "true"}
	for user, pw := range passwords {
		env[broker.PasswordVar(user)] = pw
	}
	for _, name := range shop.Names() {
		env[strings.ToUpper(name)+"_ADDR"] = "127.0.0.1:0"
	}
	cfg, err := config.LoadFor(shop, func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	cfg.Test.StreamCheck = 200 * time.Millisecond
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	out := &logbuf.Buffer{}
	go func() { done <- Run(runCtx, cfg, shop.Names(), slog.New(slog.NewTextHandler(out, nil))) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	urls := map[string]string{}
	listening := regexp.MustCompile(`msg="http listening" service=([a-z0-9]+) addr=(\S+)`)
	poll.Until(t, time.Minute, "every service listens", func() bool {
		for _, m := range listening.FindAllStringSubmatch(out.String(), -1) {
			urls[m[1]] = "http://" + m[2]
		}
		return len(urls) == len(shop)
	})

	// Not ready, saying why, where a stream is wrong; payment, whose
	// stream the keeper remade, is ready.
	for service, streams := range map[string][]string{"order": {"FULFILLMENT", "INVENTORY"}, "inventory": {"INVENTORY"}, "fulfillment": {"FULFILLMENT"}} {
		poll.Until(t, time.Minute, service+" not ready, naming "+strings.Join(streams, " and "), func() bool {
			r := get200(t, urls[service]+"/readyz")
			for _, s := range streams {
				if !strings.Contains(r, s+": configuration differs") || !strings.Contains(r, "Storage: Memory, want File") {
					return false
				}
			}
			return strings.Contains(r, `"status":"unavailable"`)
		})
	}
	if err := httpx.WaitReady(ctx, nil, urls["payment"]); err != nil {
		t.Fatal(err)
	}
	if line := logLine(out.String(), "level=ERROR", "deleted it and created it again", "stream=PAYMENT"); !strings.Contains(line, "Storage") ||
		!strings.Contains(line, "RePublish") {
		t.Errorf("the empty PAYMENT remade: %q; log:\n%s", line, out.String())
	}
	for _, s := range []string{"FULFILLMENT", "INVENTORY"} {
		line := logLine(out.String(), "level=ERROR", "refuses to restore", "stream="+s)
		for _, want := range []string{"Storage: Memory, want File", "MaxMsgs: 1, want -1", "Discard: DiscardOld, want DiscardNew", "messages=1"} {
			if !strings.Contains(line, want) {
				t.Errorf("%s: the ERROR %q does not say %q; log:\n%s", s, line, want, out.String())
			}
		}
		if !strings.Contains(get200(t, urls["order"]+"/metrics"), `shop_stream_config_drift{service="order",stream="`+s+`"} 1`) {
			t.Errorf("/metrics shows no drift of %s", s)
		}
	}

	// A restock while INVENTORY is wrong: committed, held in the outbox.
	if status, body := call(t, "PUT", urls["inventory"]+"/stock/SKU-H", nil, `{"on_hand":10,"price":500}`); status != http.StatusOK {
		t.Fatalf("restock: %d %s", status, body)
	}
	time.Sleep(time.Second) // several checks and relay rounds: nothing may reach a wrong stream
	for _, s := range []string{"FULFILLMENT", "INVENTORY"} {
		st, err := keeper.Stream(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		if n := st.CachedInfo().State.Msgs; n != 1 {
			t.Errorf("%s holds %d messages, want only the one it was given", s, n)
		}
	}

	// The repair path: delete the stream as the keeper's user; the keeper
	// creates it again.
	for _, s := range []string{"FULFILLMENT", "INVENTORY"} {
		if err := keeper.DeleteStream(ctx, s); err != nil {
			t.Fatalf("delete %s as the keeper's user: %v", s, err)
		}
	}
	for _, name := range shop.Names() {
		wait, stop := context.WithTimeout(ctx, time.Minute)
		err := httpx.WaitReady(wait, nil, urls[name])
		stop()
		if err != nil {
			t.Fatalf("%s not ready after the repair: %v; /readyz: %s", name, err, get200(t, urls[name]+"/readyz"))
		}
	}

	// Nothing lost: the restock reached the order service, every paid
	// order completes.
	var ids []string
	for i := range 5 {
		var order struct {
			ID     string `json:"order_id"`
			Status string `json:"status"`
		}
		key := fmt.Sprintf("hostile-%d-%s", i, uuid.NewString())
		poll.Until(t, time.Minute, "the order service sells SKU-H", func() bool {
			status, body := call(t, "POST", urls["order"]+"/orders", map[string]string{"Idempotency-Key": key},
				`{"customer_id":"c-1","items":[{"sku":"SKU-H","quantity":1}]}`)
			return status == http.StatusCreated && json.Unmarshal(body, &order) == nil
		})
		ids = append(ids, order.ID)
	}
	status := func(id string) string {
		var order struct{ Status string }
		_, body := call(t, "GET", urls["order"]+"/orders/"+id, nil, "")
		_ = json.Unmarshal(body, &order)
		return order.Status
	}
	for _, id := range ids {
		poll.Until(t, time.Minute, id+" WAIT_PAY", func() bool { return status(id) == "WAIT_PAY" })
		if code, body := call(t, "POST", urls["payment"]+"/payments/"+id+"/simulate", nil, `{"outcome":"succeeded"}`); code != http.StatusOK {
			t.Fatalf("pay %s: %d %s", id, code, body)
		}
	}
	for _, id := range ids {
		poll.Until(t, time.Minute, id+" COMPLETED", func() bool { return status(id) == "COMPLETED" })
	}
	vshop, closePools, err := OpenShop(ctx, cfg.Schemas(), 1)
	if err != nil {
		t.Fatal(err)
	}
	defer closePools()
	rep, err := verify.Wait(ctx, vshop, time.Hour, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() {
		var b strings.Builder
		rep.Write(&b)
		t.Errorf("shop verify:\n%s", b.String())
	}
}

func streamNames(t *testing.T, js jetstream.JetStream) []string {
	t.Helper()
	var names []string
	lister := js.StreamNames(context.Background())
	for n := range lister.Name() {
		names = append(names, n)
	}
	if err := lister.Err(); err != nil {
		t.Fatal(err)
	}
	return names
}
