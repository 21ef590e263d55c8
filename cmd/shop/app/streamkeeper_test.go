package app

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/poll"
	"github.com/shop-ref/shop/services"
)

// One check of the keeper, as the streams user, restores every stream a
// hand that may update streams tampered with — the ways found with the
// services' own credentials, and a stream made before the shop denied
// deletes and purges — logs each at ERROR with its fields, and counts it.
// A drift the server refuses to revert (storage, sealed) is remade on a
// stream that holds no message, and left alone, logged once (not at every
// check) and shown by the drift metric, on one that holds messages.
func TestStreamKeeperRestoresTamperedStreamsInOneCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ns, _ := natstest.NewSecured(t, services.All.Access())
	_, admin := ns.Connect(t)
	_, js := ns.ConnectAs(t, broker.StreamsUser)
	cfg, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	wants := shopStreams(cfg)
	want := map[string]jetstream.StreamConfig{}
	for _, w := range wants {
		want[w.Name] = w
		c := w
		if w.Name == "INVENTORY" {
			c.Storage = jetstream.MemoryStorage // empty: deleted and created again
		}
		if w.Name == "PAYMENT" {
			// As the shop created its streams before: deletes, purges and
			// rollups allowed, no direct get, the limits left to the server.
			c = jetstream.StreamConfig{Name: w.Name, Subjects: w.Subjects, Retention: w.Retention, Storage: w.Storage,
				Replicas: 1, Duplicates: w.Duplicates, MaxAge: w.MaxAge, Discard: w.Discard, AllowRollup: true}
		}
		if _, err := admin.CreateStream(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	tampered := want["ORDERS"]
	tampered.RePublish = &jetstream.RePublish{Source: ">", Destination: "inventory.stolen.>"}
	tampered.Subjects = append(slices.Clone(tampered.Subjects), "legacy.orders.>")
	tampered.MaxAge, tampered.Duplicates, tampered.MaxMsgs, tampered.AllowDirect = time.Hour, time.Minute, 10, false
	if _, err := admin.UpdateStream(ctx, tampered); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Publish(ctx, "fulfillment.x.Junk", nil); err != nil {
		t.Fatal(err)
	}
	sealed := want["FULFILLMENT"]
	sealed.Sealed = true
	if _, err := admin.UpdateStream(ctx, sealed); err != nil {
		t.Fatal(err)
	}

	out := &logbuf.Buffer{}
	k := newStreamKeeper(js, wants, slog.New(slog.NewTextHandler(out, nil)))
	k.check(ctx)

	for _, name := range []string{"ORDERS", "PAYMENT", "INVENTORY"} {
		st, err := admin.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if d := broker.Drift(st.CachedInfo().Config, want[name]); len(d) > 0 {
			t.Errorf("%s not restored: %v", name, d)
		}
	}
	log := out.String()
	for stream, fields := range map[string][]string{
		"ORDERS":  {"Subjects", "MaxMsgs", "MaxAge", "Duplicates", "RePublish", "AllowDirect"},
		"PAYMENT": {"DenyDelete", "DenyPurge", "AllowRollup", "AllowDirect"},
	} {
		line := logLine(log, "level=ERROR", "restored it", "stream="+stream)
		if line == "" {
			t.Fatalf("no ERROR restoring %s; log:\n%s", stream, log)
		}
		if !strings.Contains(line, "fields=\"["+strings.Join(fields, " ")+"]\"") {
			t.Errorf("%s: %s; want the fields %v", stream, line, fields)
		}
		if n := metric(t, k.collectors(), "shop_stream_drift_repaired_total", stream); n != 1 {
			t.Errorf("%s repaired %v times by the metric, want 1", stream, n)
		}
	}
	if line := logLine(log, "level=ERROR", "deleted it and created it again", "stream=INVENTORY"); !strings.Contains(line, "fields=[Storage]") {
		t.Errorf("the empty INVENTORY in memory: %q; want an ERROR naming Storage; log:\n%s", line, log)
	}
	if logLine(log, "deleted it", "stream=FULFILLMENT") != "" {
		t.Errorf("FULFILLMENT, which holds a message, was deleted:\n%s", log)
	}
	if line := logLine(log, "level=ERROR", "refuses to restore", "stream=FULFILLMENT"); !strings.Contains(line, "Sealed") {
		t.Errorf("the sealed FULFILLMENT: %q; want an ERROR naming Sealed; log:\n%s", line, log)
	}
	if n := metric(t, k.collectors(), "shop_stream_config_drift", "FULFILLMENT"); n != 1 {
		t.Errorf("shop_stream_config_drift{stream=FULFILLMENT} = %v, want 1", n)
	}

	k.check(ctx)
	if again := strings.TrimPrefix(out.String(), log); again != "" {
		t.Errorf("a second check logged:\n%s", again)
	}
	if n := metric(t, k.collectors(), "shop_stream_drift_repaired_total", "ORDERS"); n != 1 {
		t.Errorf("ORDERS repaired %v times after a second check, want 1", n)
	}
}

// A process given the keeper's password creates the shop's streams and
// restores a stream tampered with while it runs, within a check, and
// serves the count; one without it creates nothing and only reports: its
// own stream's drift at ERROR, once per change, naming the variable that
// would let it restore, and /readyz not ready, naming the stream and the
// field, until the stream is right again.
func TestAProcessKeepsOrReportsItsStreams(t *testing.T) {
	t.Parallel()
	fast := func(c *config.Config) { c.Test.StreamCheck = 100 * time.Millisecond }

	t.Run("with the keeper's password, it restores", func(t *testing.T) {
		t.Parallel()
		ns, passwords := natstest.NewSecured(t, services.All.Access())
		out, url := runInventoryWith(t, map[string]string{"NATS_URL": ns.URL(), "INVENTORY_NATS_PASSWORD": passwords["inventory"],
			"STREAMS_NATS_PASSWORD": passwords[broker.StreamsUser]}, fast)
		_, admin := ns.Connect(t)
		ctx := context.Background()
		// The keeper creates ORDERS too, which no order service runs to
		// use.
		poll.Until(t, time.Minute, "ORDERS created", func() bool {
			_, err := admin.Stream(ctx, "ORDERS")
			return err == nil
		})
		// And its consumers, as `nats consumer ls` shows them: the
		// embedded nats-server (v2.15.3) races, under -race, a stream update
		// against a consumer being created on that stream (filestore
		// UpdateConfig against addConsumerWithAssignment), which failed CI
		// once. A tamperer racing the process's start is not what this test
		// is about.
		poll.Until(t, time.Minute, "inventory's consumers created", func() bool {
			for _, r := range services.All.Readers() {
				if r.Service != "inventory" {
					continue
				}
				if _, err := admin.Consumer(ctx, r.Stream, r.Name); err != nil {
					return false
				}
			}
			return true
		})
		cfg := streamConfig(t, admin, "ORDERS")
		cfg.RePublish = &jetstream.RePublish{Source: ">", Destination: "inventory.stolen.>"}
		if _, err := admin.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		poll.Until(t, time.Minute, "ORDERS restored", func() bool { return streamConfig(t, admin, "ORDERS").RePublish == nil })
		poll.Until(t, time.Minute, "the restore logged", func() bool {
			return strings.Contains(logLine(out.String(), "level=ERROR", "restored it", "stream=ORDERS"), "fields=[RePublish]")
		})
		if !strings.Contains(get200(t, url+"/metrics"), `shop_stream_drift_repaired_total{service="inventory",stream="ORDERS"} 1`) {
			t.Errorf("/metrics does not count the repair:\n%s", get200(t, url+"/metrics"))
		}
		if s := out.String(); strings.Contains(s, "permissions violation") {
			t.Errorf("log:\n%s", s)
		}
	})

	t.Run("without it, it reports its own stream once per change", func(t *testing.T) {
		t.Parallel()
		ns, passwords := natstest.NewSecured(t, services.All.Access())
		_, admin := ns.Connect(t)
		ctx := context.Background()
		// INVENTORY exists already, republishing into ORDERS.
		cfg, err := LoadConfig(func(string) string { return "" })
		if err != nil {
			t.Fatal(err)
		}
		var inv jetstream.StreamConfig
		for _, w := range shopStreams(cfg) {
			if w.Name == "INVENTORY" {
				inv = w
			}
		}
		tampered := inv
		tampered.RePublish = &jetstream.RePublish{Source: ">", Destination: "orders.stolen.>"}
		if _, err := admin.CreateStream(ctx, tampered); err != nil {
			t.Fatal(err)
		}
		out, url := startInventory(t, map[string]string{"NATS_URL": ns.URL(), "INVENTORY_NATS_PASSWORD": passwords["inventory"]}, fast, false)
		drifts := func() []string {
			var lines []string
			for l := range strings.Lines(out.String()) {
				if strings.Contains(l, "level=ERROR") && strings.Contains(l, "stream configuration differs") {
					lines = append(lines, l)
				}
			}
			return lines
		}
		poll.Until(t, time.Minute, "the drift logged", func() bool { return len(drifts()) > 0 })
		time.Sleep(time.Second) // ten checks
		if d := drifts(); len(d) != 1 || !strings.Contains(d[0], "fields=[RePublish]") || !strings.Contains(d[0], "STREAMS_NATS_PASSWORD") ||
			!strings.Contains(d[0], "stream=INVENTORY") {
			t.Fatalf("drift logged %d times, want once, naming RePublish and STREAMS_NATS_PASSWORD:\n%s", len(d), out.String())
		}
		if c := streamConfig(t, admin, "INVENTORY"); c.RePublish == nil {
			t.Fatal("INVENTORY changed by a process that may not update it")
		}
		// Not ready, saying why; ORDERS, which no keeper creates, is
		// reported missing.
		poll.Until(t, time.Minute, "/readyz to name the drift", func() bool {
			r := get200(t, url+"/readyz")
			return strings.Contains(r, `"status":"unavailable"`) && strings.Contains(r, "INVENTORY: configuration differs") &&
				strings.Contains(r, "RePublish") && strings.Contains(r, "ORDERS: missing")
		})
		if _, err := admin.Stream(ctx, "ORDERS"); err == nil {
			t.Error("ORDERS exists: a process without the keeper's password created it")
		}
		if !strings.Contains(get200(t, url+"/metrics"), `shop_stream_config_drift{service="inventory",stream="INVENTORY"} 1`) {
			t.Errorf("/metrics does not show the drift")
		}

		tampered.MaxAge = 9 * 24 * time.Hour // another change: reported again
		if _, err := admin.UpdateStream(ctx, tampered); err != nil {
			t.Fatal(err)
		}
		poll.Until(t, time.Minute, "the new drift logged", func() bool { return len(drifts()) == 2 })
		if d := drifts()[1]; !strings.Contains(d, "fields=\"[MaxAge RePublish]\"") {
			t.Errorf("the second drift: %s", d)
		}
		if _, err := admin.UpdateStream(ctx, inv); err != nil { // an operator restores it
			t.Fatal(err)
		}
		poll.Until(t, time.Minute, "the end of the drift logged", func() bool {
			return logLine(out.String(), "level=INFO", "is the shop's again", "stream=INVENTORY") != ""
		})
		// Ready again: a missing stream does not decide, like a broker outage.
		poll.Until(t, time.Minute, "/readyz ready again", func() bool {
			return strings.Contains(get200(t, url+"/readyz"), `"status":"ok"`)
		})
		if s := out.String(); strings.Contains(s, "permissions violation") || strings.Count(s, "no stream keeper in this process") != 1 {
			t.Errorf("log:\n%s", s)
		}
	})
}

// A stream created with the shop's configuration shows no drift on the
// server that created it: a field the server fills in by itself would be
// restored (and logged) at every check.
func TestShopStreamsShowNoDrift(t *testing.T) {
	t.Parallel()
	ns := natstest.New(t)
	_, js := ns.Connect(t)
	cfg, err := LoadConfig(func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range shopStreams(cfg) {
		st, err := broker.CreateStreamIfMissing(context.Background(), js, w)
		if err != nil {
			t.Fatal(err)
		}
		if d := broker.Drift(streamConfig(t, js, w.Name), w); len(d) > 0 || !slices.Equal(st.CachedInfo().Config.Subjects, w.Subjects) {
			t.Errorf("%s: drift %v on a fresh stream", w.Name, d)
		}
	}
}

func streamConfig(t *testing.T, js jetstream.JetStream, name string) jetstream.StreamConfig {
	t.Helper()
	st, err := js.Stream(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return st.CachedInfo().Config
}

// logLine is the first line of log that contains every one of parts.
func logLine(log string, parts ...string) string {
	for l := range strings.Lines(log) {
		if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(l, p) }) {
			return l
		}
	}
	return ""
}

// metric is the value of the series name{stream} of collectors.
func metric(t *testing.T, collectors []prometheus.Collector, name, stream string) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors...)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "stream" && l.GetValue() == stream {
					if c := m.GetCounter(); c != nil {
						return c.GetValue()
					}
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return 0
}
