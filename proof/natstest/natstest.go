// Package natstest runs a real NATS server with JetStream inside the test
// process, on a random port with a temporary store, and can stop and restart
// it on the same port to simulate a broker outage.
package natstest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
)

// Server is a test's NATS server.
type Server struct {
	t    testing.TB
	port int
	dir  string
	opts []broker.Option
	srv  *server.Server

	passwords map[string]string // NewSecured: by user, AdminUser's among them
}

// New starts a server and stops it when the test ends. opts are passed to
// broker.Embedded, after the tests' fsync policy:
//
// The tests' servers fsync as nats-server does by default (every two
// minutes), not as the shop's own server does (before every ack,
// broker.WithSyncAlways). A test's stream lives in a temporary directory
// that no OS crash will ever be asked to keep, and an fsync per message
// makes JetStream slow for the tests that publish thousands: on the
// development machine (2026-12-01) 0.35–0.5 ms per acknowledged publish
// instead of 0.03–0.09, an async burst 3,000–3,800 msgs/s instead of
// 41,000–78,000, and with -race pkg/outbox took 65 s instead of 24 s and
// proof/flowtest 57 s instead of 30 s. A test about durability itself passes
// broker.WithSyncAlways(); `shop all` always syncs.
func New(t testing.TB, opts ...broker.Option) *Server {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &Server{t: t, port: port, dir: t.TempDir(), opts: append([]broker.Option{broker.WithSyncInterval(broker.ServerDefaultSyncInterval)}, opts...)}
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

// AdminUser is the user a secured test server (NewSecured) has besides the
// shop's: every permission, for what a test does behind the services' backs
// (Connect). The shop itself knows no such user.
const AdminUser = "test-admin"

// NewSecured starts a server, as New, that requires the NATS users of
// services (the shop's: services.All.Access()), broker.AuditUser and
// broker.StreamsUser, with random passwords, and AdminUser: an anonymous
// client is refused. It returns the server and the passwords by user name;
// Connect connects as AdminUser, ConnectAs as any user.
func NewSecured(t testing.TB, services []broker.Access, opts ...broker.Option) (*Server, map[string]string) {
	t.Helper()
	passwords := map[string]string{broker.AuditUser: rand.Text(), broker.StreamsUser: rand.Text()}
	for _, a := range services {
		passwords[a.User] = rand.Text()
	}
	users, err := broker.Users(services, passwords)
	if err != nil {
		t.Fatal(err)
	}
	return newSecured(t, users, passwords, opts)
}

// NewSecuredFor is NewSecured with the users of services instead of the
// shop's (each with broker.Permissions, no audit user): for tests of the
// libraries on their own streams under a service's permissions.
func NewSecuredFor(t testing.TB, services []broker.Access, opts ...broker.Option) (*Server, map[string]string) {
	t.Helper()
	passwords := map[string]string{}
	var users []*server.User
	for _, a := range services {
		passwords[a.User] = rand.Text()
		users = append(users, &server.User{Username: a.User, Password: passwords[a.User], Permissions: broker.Permissions(a)})
	}
	return newSecured(t, users, passwords, opts)
}

func newSecured(t testing.TB, users []*server.User, passwords map[string]string, opts []broker.Option) (*Server, map[string]string) {
	t.Helper()
	passwords[AdminUser] = rand.Text()
	users = append(users, &server.User{Username: AdminUser, Password: passwords[AdminUser]})
	s := New(t, append(opts, broker.WithUsers(users))...)
	s.passwords = passwords
	return s, maps.Clone(passwords)
}

// URL is the client URL of the server.
func (s *Server) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", s.port) }

// Start starts the server (again), keeping its port and its streams.
func (s *Server) Start() {
	s.t.Helper()
	var err error
	for range 50 { // the port may linger for a moment after a stop
		s.srv, err = broker.Embedded("127.0.0.1", s.port, s.dir, s.opts...)
		if err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	s.t.Fatalf("start nats: %v", err)
}

// Stop shuts the server down; clients see a broker outage until Start.
func (s *Server) Stop() {
	if s.srv != nil {
		s.srv.Shutdown()
		s.srv.WaitForShutdown()
		s.srv = nil
	}
}

// DisableJetStream switches JetStream off while core NATS keeps serving:
// clients stay CONNECTED, publishes find no stream, JetStream API calls no
// responder. Its streams stay on disk; a restart (Stop, then Start) brings
// JetStream back with them. (Switching it on again inside the running
// server is not offered: in nats-server 2.15.3 that races in the server's
// own API workers and can crash the test process.)
func (s *Server) DisableJetStream() {
	s.t.Helper()
	if err := s.srv.ShutdownJetStream(); err != nil {
		s.t.Fatalf("disable jetstream: %v", err)
	}
}

// Restart stops the server and starts it again on the same port and store.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	s.Start()
}

// StartWithoutJetStream starts the stopped server (again) with core NATS
// only, as a cluster node without JetStream quorum looks to a client: it
// connects, and every JetStream call fails. Start brings JetStream back.
func (s *Server) StartWithoutJetStream() {
	s.t.Helper()
	var err error
	for range 50 {
		o := &server.Options{Host: "127.0.0.1", Port: s.port, NoSigs: true, NoLog: true}
		for _, opt := range s.opts { // the users of NewSecured, if any; JetStream stays off
			opt(o)
		}
		o.JetStream = false
		s.srv, err = server.NewServer(o)
		if err == nil {
			s.srv.Start()
			if s.srv.ReadyForConnections(10 * time.Second) {
				return
			}
			s.srv.Shutdown()
			err = errors.New("not ready after 10s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	s.t.Fatalf("start nats without jetstream: %v", err)
}

// Connect opens a client connection that reconnects forever, closed when the
// test ends: anonymous, or as AdminUser on a secured server.
func (s *Server) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	if s.passwords != nil {
		return s.ConnectAs(t, AdminUser)
	}
	return s.connect(t)
}

// Password returns user's password on a secured server.
func (s *Server) Password(user string) (string, bool) {
	p, ok := s.passwords[user]
	return p, ok
}

// ConnectAs is Connect as user of a secured server (NewSecured).
func (s *Server) ConnectAs(t testing.TB, user string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	p, ok := s.passwords[user]
	if !ok {
		t.Fatalf("natstest: no user %q on this server", user)
	}
	return s.connect(t, broker.UserOptions(user, p)...)
}

func (s *Server) connect(t testing.TB, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(s.URL(), append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// Stream creates a stream for test subjects with the shop's configuration
// (broker.StreamConfig), or updates one to it, but for one thing: a test may
// delete or purge its messages, to play a broker that lost them (the
// shop's streams deny both, and JetStream never lets a stream allow them
// again). The user of js must be allowed to update the stream when it
// exists with another configuration: AdminUser, or an open server's.
func (s *Server) Stream(t testing.TB, js jetstream.JetStream, name string, subjects ...string) jetstream.Stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg := broker.StreamConfig(name, 1, broker.DefaultLimits, subjects...)
	cfg.DenyDelete, cfg.DenyPurge = false, false
	st, _, err := broker.KeepStream(ctx, js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// Event is an event as a producer's outbox relay publishes it, for tests
// that play the producer.
type Event struct {
	ID            uuid.UUID // zero: a new UUIDv7
	Prefix        string    // subject prefix: "orders", "inventory", …
	AggregateType string    // "order", "product"
	AggregateID   string
	Type          string
	Seq           int64
	SchemaVersion int // zero: 1
	Payload       any // []byte is sent as it is, anything else as JSON
}

// Msg builds the message with the contract's subject and headers.
func (e Event) Msg(t testing.TB) *nats.Msg {
	t.Helper()
	if e.ID == uuid.Nil {
		e.ID = uuid.Must(uuid.NewV7())
	}
	data, ok := e.Payload.([]byte)
	if !ok {
		var err error
		if data, err = json.Marshal(e.Payload); err != nil {
			t.Fatal(err)
		}
	}
	m := nats.NewMsg(e.Prefix + "." + e.AggregateID + "." + e.Type)
	m.Data = data
	m.Header.Set(jetstream.MsgIDHeader, e.ID.String())
	m.Header.Set("Event-Type", e.Type)
	m.Header.Set("Aggregate-Type", e.AggregateType)
	m.Header.Set("Aggregate-Id", e.AggregateID)
	m.Header.Set("Aggregate-Seq", strconv.FormatInt(e.Seq, 10))
	m.Header.Set("Schema-Version", strconv.Itoa(cmp.Or(e.SchemaVersion, 1)))
	m.Header.Set("Occurred-At", time.Now().UTC().Format(time.RFC3339Nano))
	return m
}

// Publish publishes m to JetStream and returns the ack.
func Publish(t testing.TB, js jetstream.JetStream, m *nats.Msg) *jetstream.PubAck {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := js.PublishMsg(ctx, m)
	if err != nil {
		t.Fatalf("publish %s: %v", m.Subject, err)
	}
	return ack
}

// PublishAll publishes n messages without waiting for each ack, at most
// 500 awaiting theirs at once, and fails t on the first error. msg builds
// the i-th message and its Nats-Msg-Id. It fills a stream as fast as the
// broker stores: the benchmarks' ceiling and their backlogs.
func PublishAll(t testing.TB, js jetstream.JetStream, n int, msg func(i int) (m *nats.Msg, id string)) {
	t.Helper()
	const inFlight = 500
	futures := make([]jetstream.PubAckFuture, 0, inFlight)
	for off := 0; off < n; off += inFlight {
		futures = futures[:0]
		for i := off; i < off+inFlight && i < n; i++ {
			m, id := msg(i)
			f, err := js.PublishMsgAsync(m, jetstream.WithMsgID(id))
			if err != nil {
				t.Fatalf("publish %s: %v", m.Subject, err)
			}
			futures = append(futures, f)
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				t.Fatalf("publish %s: %v", f.Msg().Subject, err)
			}
		}
	}
}

// Settled reports whether the durable consumer has acked (or terminated)
// every message of stream. It reads the ack floor, not NumPending: a
// consumer still being created reports nothing pending.
func Settled(t testing.TB, js jetstream.JetStream, stream, consumer string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := st.Consumer(ctx, consumer)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.NumAckPending == 0 && info.AckFloor.Stream >= st.CachedInfo().State.LastSeq
}
