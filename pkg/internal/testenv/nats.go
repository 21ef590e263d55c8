package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Server is a test's NATS server with JetStream.
type Server struct {
	t    testing.TB // NATS's, for Start, Restart and DisableJetStream
	port int
	dir  string
	srv  *server.Server
}

// NATS starts a server on a random port of 127.0.0.1, storing its streams in
// a temporary directory, and stops it when the test ends. It fsyncs as
// nats-server does by default (every two minutes), not before every ack: a
// test's stream never has to survive an OS crash, and an fsync per message
// makes the tests that publish thousands several times slower.
func NATS(t testing.TB) *Server {
	t.Helper()
	s, err := StartNATS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s.t = t
	t.Cleanup(s.Stop)
	return s
}

// StartNATS is NATS for code that has no testing.TB (a runnable example):
// streams go to dir, and the caller stops the server with Stop. Its Start,
// Restart and DisableJetStream are only for a Server from NATS.
func StartNATS(dir string) (*Server, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &Server{port: port, dir: dir}
	return s, s.start()
}

// URL is the client URL of the server.
func (s *Server) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", s.port) }

// Start starts the server (again), keeping its port and its streams.
func (s *Server) Start() {
	s.t.Helper()
	if err := s.start(); err != nil {
		s.t.Fatalf("start nats: %v", err)
	}
}

func (s *Server) start() error {
	var err error
	for range 50 { // the port may linger for a moment after a stop
		if err = s.startOnce(); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

func (s *Server) startOnce() error {
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: s.port, JetStream: true, StoreDir: s.dir,
		SyncInterval: 2 * time.Minute, NoSigs: true, NoLog: true,
	})
	if err != nil {
		return err
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		return errors.New("not ready after 10s")
	}
	s.srv = srv
	return nil
}

// Stop shuts the server down; clients see a broker outage until Start.
func (s *Server) Stop() {
	if s.srv != nil {
		s.srv.Shutdown()
		s.srv.WaitForShutdown()
		s.srv = nil
	}
}

// Restart stops the server and starts it again on the same port and store.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	s.Start()
}

// DisableJetStream switches JetStream off while core NATS keeps serving:
// clients stay connected, publishes find no stream. A restart brings
// JetStream back with its streams.
func (s *Server) DisableJetStream() {
	s.t.Helper()
	if err := s.srv.ShutdownJetStream(); err != nil {
		s.t.Fatalf("disable jetstream: %v", err)
	}
}

// Connect opens a client connection that reconnects forever, closed when the
// test ends.
func (s *Server) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(s.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
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

// Stream creates the stream name for subjects, or updates it to this
// configuration: file storage, limits retention (messages stay after they
// are consumed) and a ten-minute duplicate window, as a producer's stream
// would have in production.
func (s *Server) Stream(t testing.TB, js jetstream.JetStream, name string, subjects ...string) jetstream.Stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: subjects, Storage: jetstream.FileStorage,
		Retention: jetstream.LimitsPolicy, Duplicates: 10 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	return st
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

// PublishAll publishes n messages without waiting for each ack, at most 500
// awaiting theirs at once, and fails t on the first error. msg builds the
// i-th message and its Nats-Msg-Id.
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
