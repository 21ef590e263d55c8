package broker_test

import (
	"context"
	"errors"
	"flag"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/services"
)

var update = flag.Bool("update", false, "rewrite deploy/nats/auth.conf from broker.AuthConfig")

// The deployed server's users are the ones the embedded server gets: the
// file is the rendering of services.All.Access(), and fails here when either
// changes without the other (go test ./internal/broker -run AuthConf -update).
func TestAuthConfMatchesTheTable(t *testing.T) {
	const path = "../../deploy/nats/auth.conf"
	want := authConfHeader + broker.AuthConfig(services.Deployed().Access(), func(user string) string { return "$" + broker.PasswordVar(user) })
	if *update {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	have, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(have) != want {
		t.Errorf("%s differs from broker.AuthConfig; regenerate it: go test ./internal/broker -run TestAuthConfMatchesTheTable -update", path)
	}
}

const authConfHeader = `# The NATS users of the shop, included by single.conf and cluster.conf:
# one user per service, allowed only its own subjects, to look up (never
# create or update) its own stream and the streams it reads, and to run its
# own durable consumers; the read-only audit user of shop verify, shop
# outbox and the reconciler, which creates no consumer; and the stream
# keeper (streams), the only user that may create, update or delete a
# stream, to hold the streams to the shop's configuration. An anonymous
# client is refused. Each password comes from the server's environment
# (ORDER_NATS_PASSWORD, …, STREAMS_NATS_PASSWORD; docker-compose.yml).
#
# Generated from internal/broker (broker.AuthConfig); do not edit by hand:
# go test ./internal/broker -run TestAuthConfMatchesTheTable -update
`

// setupSecured starts a secured server with the contract's streams, created
// by the stream keeper, the only user that may.
func setupSecured(t *testing.T) *natstest.Server {
	t.Helper()
	srv, _ := natstest.NewSecured(t, services.All.Access())
	_, js := srv.ConnectAs(t, broker.StreamsUser)
	for _, a := range services.All.Access() {
		srv.Stream(t, js, a.Stream, a.Subjects...)
	}
	return srv
}

func msgs(t *testing.T, js jetstream.JetStream, stream string) uint64 {
	t.Helper()
	st, err := js.Stream(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	return st.CachedInfo().State.Msgs
}

func TestPermissions(t *testing.T) {
	t.Parallel()
	srv := setupSecured(t)
	_, admin := srv.Connect(t)

	t.Run("a service cannot publish into another's stream", func(t *testing.T) {
		before := msgs(t, admin, "ORDERS")
		_, js := srv.ConnectAs(t, "payment")
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		_, err := js.Publish(ctx, "orders.x.OrderCreated", []byte("{}"))
		if err == nil {
			t.Fatal("payment published into ORDERS")
		}
		if after := msgs(t, admin, "ORDERS"); after != before {
			t.Errorf("ORDERS holds %d messages, had %d", after, before)
		}
	})
	t.Run("the violation reaches the client's error handler", func(t *testing.T) {
		violations := make(chan error, 1)
		nc, err := nats.Connect(srv.URL(), nats.UserInfo("payment", passwordOf(t, srv, "payment")),
			nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
				select {
				case violations <- err:
				default:
				}
			}))
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		if err := nc.Publish("orders.x.OrderCreated", []byte("{}")); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-violations:
			if !errors.Is(err, nats.ErrPermissionViolation) {
				t.Errorf("error handler got %v, want a permissions violation", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no permissions violation reported")
		}
	})
	t.Run("a service publishes its own events", func(t *testing.T) {
		for _, a := range services.All.Access() {
			_, js := srv.ConnectAs(t, a.User)
			natstest.Publish(t, js, nats.NewMsg(a.Subjects[0][:len(a.Subjects[0])-1]+"x.Test"))
		}
	})
	t.Run("no service and not the audit user can delete or purge a stream", func(t *testing.T) {
		// Each service its own stream, the one it may otherwise change most;
		// the audit user every stream.
		targets := map[string][]string{broker.AuditUser: nil}
		for _, a := range services.All.Access() {
			targets[a.User] = []string{a.Stream}
			targets[broker.AuditUser] = append(targets[broker.AuditUser], a.Stream)
		}
		for user, streams := range targets {
			_, js := srv.ConnectAs(t, user)
			for _, s := range streams {
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				if err := js.DeleteStream(ctx, s); err == nil {
					t.Errorf("%s deleted %s", user, s)
				}
				if st, err := js.Stream(ctx, s); err == nil {
					if err := st.Purge(ctx); err == nil {
						t.Errorf("%s purged %s", user, s)
					}
				}
				cancel()
			}
		}
		for _, s := range services.All.Access() {
			if _, err := admin.Stream(context.Background(), s.Stream); err != nil {
				t.Errorf("stream %s: %v", s.Stream, err)
			}
		}
	})
	t.Run("a service cannot pull another service's consumer", func(t *testing.T) {
		_, inv := srv.ConnectAs(t, "inventory")
		st, err := inv.Stream(context.Background(), "ORDERS")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.CreateOrUpdateConsumer(context.Background(), jetstream.ConsumerConfig{Durable: "inventory-orders", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
			t.Fatalf("inventory's own consumer: %v", err)
		}
		_, pay := srv.ConnectAs(t, "payment")
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		if _, err := pay.Consumer(ctx, "ORDERS", "inventory-orders"); err == nil {
			t.Error("payment looked up inventory's consumer")
		}
		if _, err := pay.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{Durable: "inventory-orders"}); err == nil {
			t.Error("payment changed inventory's consumer")
		}
	})
	t.Run("the audit user reads a stream and cannot touch a service's durable", func(t *testing.T) {
		_, audit := srv.ConnectAs(t, broker.AuditUser)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := audit.Stream(ctx, "ORDERS")
		if err != nil {
			t.Fatal(err)
		}
		// By direct get (the stream allows it): no consumer needed.
		if _, err := st.GetMsg(ctx, st.CachedInfo().State.FirstSeq); err != nil {
			t.Fatalf("read ORDERS: %v", err)
		}
		short, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		if err := audit.DeleteConsumer(short, "ORDERS", "inventory-orders"); err == nil {
			t.Error("the audit user deleted inventory's consumer")
		}
		if _, err := audit.Publish(short, "orders.x.OrderCreated", nil); err == nil {
			t.Error("the audit user published into ORDERS")
		}
	})
	t.Run("the audit user creates no consumer, durable or not, and changes no stream", func(t *testing.T) {
		_, audit := srv.ConnectAs(t, broker.AuditUser)
		before := consumers(t, admin, "ORDERS")
		short := func() context.Context {
			ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
			t.Cleanup(cancel)
			return ctx
		}
		st, err := audit.Stream(short(), "ORDERS")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.CreateOrUpdateConsumer(short(), jetstream.ConsumerConfig{Durable: "audit-probe", AckPolicy: jetstream.AckExplicitPolicy}); err == nil {
			t.Error("the audit user created a durable consumer")
		}
		if _, err := st.CreateOrUpdateConsumer(short(), jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy}); err == nil {
			t.Error("the audit user created an ephemeral consumer")
		}
		if cons, err := st.OrderedConsumer(short(), jetstream.OrderedConsumerConfig{}); err == nil {
			if _, err := cons.Next(jetstream.FetchMaxWait(500 * time.Millisecond)); err == nil {
				t.Error("the audit user read ORDERS through an ordered consumer")
			}
		}
		cfg := st.CachedInfo().Config
		cfg.MaxAge = time.Hour
		if _, err := audit.UpdateStream(short(), cfg); err == nil {
			t.Error("the audit user updated ORDERS")
		}
		if _, err := audit.CreateStream(short(), jetstream.StreamConfig{Name: "AUDIT_PROBE", Subjects: []string{"audit-probe.>"}}); err == nil {
			t.Error("the audit user created a stream")
		}
		if after := consumers(t, admin, "ORDERS"); !slices.Equal(after, before) {
			t.Errorf("consumers on ORDERS: %v, were %v", after, before)
		}
	})
	t.Run("no service can reconfigure a stream, its own included", func(t *testing.T) {
		// Each a weapon found with a service's own credentials: RePublish
		// storing a stream's messages in another's subjects, AllowRollup
		// letting one `Nats-Rollup: all` message empty the stream.
		// (natstest's streams allow purges, so the server itself would
		// accept a rollup: only the permission refuses it here.)
		all := services.All.Access()
		for i, a := range all {
			_, js := srv.ConnectAs(t, a.User)
			other := all[(i+1)%len(all)]
			for _, target := range []string{a.Stream, other.Stream} {
				for name, tamper := range map[string]func(*jetstream.StreamConfig){
					"RePublish": func(c *jetstream.StreamConfig) {
						c.RePublish = &jetstream.RePublish{Source: ">", Destination: strings.TrimSuffix(other.Subjects[0], ">") + "stolen.>"}
					},
					"AllowRollup": func(c *jetstream.StreamConfig) { c.AllowRollup = true },
				} {
					cfg := config(t, admin, target)
					tamper(&cfg)
					ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
					if _, err := js.UpdateStream(ctx, cfg); err == nil {
						t.Errorf("%s set %s on %s", a.User, name, target)
					}
					cancel()
					if c := config(t, admin, target); c.RePublish != nil || c.AllowRollup {
						t.Fatalf("%s: %s has RePublish %+v, AllowRollup %v", a.User, target, c.RePublish, c.AllowRollup)
					}
				}
			}
		}
	})
	t.Run("the stream keeper updates streams and does nothing else", func(t *testing.T) {
		_, keeper := srv.ConnectAs(t, broker.StreamsUser)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cfg := config(t, admin, "PAYMENT")
		cfg.MaxAge = 9 * 24 * time.Hour
		if _, err := keeper.UpdateStream(ctx, cfg); err != nil {
			t.Fatalf("the keeper could not update PAYMENT: %v", err)
		}
		short := func() context.Context {
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			t.Cleanup(cancel)
			return ctx
		}
		if _, err := keeper.Publish(short(), "payment.x.PaymentSucceeded", nil); err == nil {
			t.Error("the keeper published into PAYMENT")
		}
		if st, err := keeper.Stream(short(), "PAYMENT"); err != nil || st.Purge(short()) == nil {
			t.Errorf("the keeper purged PAYMENT (or could not look it up: %v)", err)
		}
		if _, err := keeper.CreateStream(short(), jetstream.StreamConfig{Name: "OTHER", Subjects: []string{"other.>"}}); err == nil {
			t.Error("the keeper created a stream that is not the shop's")
		}
		if _, err := keeper.CreateOrUpdateConsumer(short(), "PAYMENT", jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy}); err == nil {
			t.Error("the keeper created a consumer")
		}
		nc := keeper.Conn()
		if _, err := nc.Request("$JS.API.DIRECT.GET.PAYMENT", []byte(`{"seq":1}`), 300*time.Millisecond); err == nil {
			t.Error("the keeper read a message of PAYMENT")
		}
	})
	t.Run("no service can create a stream, not even a missing one", func(t *testing.T) {
		// The attack of a payment user on an empty store: its own stream in
		// memory, republishing what it publishes into ORDERS' subjects.
		for _, a := range services.All.Access() {
			_, js := srv.ConnectAs(t, a.User)
			for _, name := range append([]string{a.Stream + "_NEW"}, a.Reads()...) {
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"forge." + a.User + ".>"},
					Storage: jetstream.MemoryStorage, RePublish: &jetstream.RePublish{Source: ">", Destination: "orders.>"}})
				cancel()
				if err == nil {
					t.Errorf("%s created stream %s", a.User, name)
				}
			}
		}
	})
	t.Run("a service cannot read another's replies", func(t *testing.T) {
		// Pull deliveries come on reply subjects: a subscription to every
		// inbox would show payment inventory's messages.
		for _, subject := range []string{"_INBOX.>", broker.InboxPrefix("inventory") + ".>"} {
			nc, err := nats.Connect(srv.URL(), append(broker.UserOptions("payment", passwordOf(t, srv, "payment")),
				nats.PermissionErrOnSubscribe(true))...)
			if err != nil {
				t.Fatal(err)
			}
			sub, err := nc.SubscribeSync(subject)
			if err == nil {
				_, err = sub.NextMsg(2 * time.Second)
			}
			if !errors.Is(err, nats.ErrPermissionViolation) {
				t.Errorf("payment subscribing to %s: %v, want a permissions violation", subject, err)
			}
			nc.Close()
		}
	})
	t.Run("an anonymous client is refused", func(t *testing.T) {
		nc, err := nats.Connect(srv.URL())
		if err == nil {
			nc.Close()
			t.Fatal("anonymous connection accepted")
		}
		if !errors.Is(err, nats.ErrAuthorization) {
			t.Errorf("err = %v, want an authorization violation", err)
		}
	})
	t.Run("a wrong password is refused", func(t *testing.T) {
		nc, err := nats.Connect(srv.URL(), nats.UserInfo("order", "guess"))
		if err == nil {
			nc.Close()
			t.Fatal("wrong password accepted")
		}
	})
}

func config(t *testing.T, js jetstream.JetStream, stream string) jetstream.StreamConfig {
	t.Helper()
	st, err := js.Stream(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	return st.CachedInfo().Config
}

func consumers(t *testing.T, js jetstream.JetStream, stream string) []string {
	t.Helper()
	st, err := js.Stream(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	names := st.ConsumerNames(context.Background())
	var out []string
	for n := range names.Name() {
		out = append(out, n)
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

func passwordOf(t *testing.T, srv *natstest.Server, user string) string {
	t.Helper()
	p, ok := srv.Password(user)
	if !ok {
		t.Fatalf("no user %s", user)
	}
	return p
}

// A service named like one of the shop's own users would share that user:
// the server's user list refuses the second of a name, whoever slipped
// past registry.Validate.
func TestUsersRefuseTwoOfOneName(t *testing.T) {
	t.Parallel()
	for _, name := range broker.SystemUsers() {
		access := append(services.All.Access(), broker.Access{User: name})
		passwords := map[string]string{}
		for _, a := range access {
			passwords[a.User] = "x"
		}
		for _, u := range broker.SystemUsers() {
			passwords[u] = "x"
		}
		if _, err := broker.Users(access, passwords); err == nil || !strings.Contains(err.Error(), "two users named "+name) {
			t.Errorf("a service named %s: err = %v, want two users named %s", name, err, name)
		}
	}
	if _, err := broker.Users(services.All.Access(), nil); err == nil {
		t.Error("no passwords: want an error")
	}
}
