// Package natstest runs a real NATS server with JetStream inside the test
// process, on a random port with a temporary store, and can stop and restart
// it on the same port to simulate a broker outage.
package natstest

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

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
	srv  *server.Server
}

// New starts a server and stops it when the test ends.
func New(t testing.TB) *Server {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &Server{t: t, port: port, dir: t.TempDir()}
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

// URL is the client URL of the server.
func (s *Server) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", s.port) }

// Start starts the server (again), keeping its port and its streams.
func (s *Server) Start() {
	s.t.Helper()
	var err error
	for range 50 { // the port may linger for a moment after a stop
		s.srv, err = broker.Embedded("127.0.0.1", s.port, s.dir)
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

// Stream creates a stream for test subjects.
func (s *Server) Stream(t testing.TB, js jetstream.JetStream, name string, subjects ...string) jetstream.Stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := broker.EnsureStream(ctx, js, name, subjects...)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
