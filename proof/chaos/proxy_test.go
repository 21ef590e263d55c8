package chaos

import (
	"io"
	"net"
	"testing"
	"time"
)

// TestProxyPause checks the partition the proxy models: while paused
// nothing arrives and nothing is closed; after Resume what was sent during
// the pause arrives whole, in order.
func TestProxyPause(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	p, err := newProxy(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	client, err := net.Dial("tcp", p.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server := <-accepted
	defer server.Close()

	roundTrip := func(b byte) {
		t.Helper()
		if _, err := client.Write([]byte{b}); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 1)
		if _, err := io.ReadFull(server, got); err != nil || got[0] != b {
			t.Fatalf("read %v, %v; want %v", got, err, b)
		}
	}
	roundTrip(1)

	p.Pause()
	if _, err := client.Write([]byte{2, 3}); err != nil {
		t.Fatal(err)
	}
	_ = server.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := server.Read(make([]byte, 2)); n != 0 || !isTimeout(err) {
		t.Fatalf("during the pause: read %d bytes, %v; want a timeout (nothing, and no close)", n, err)
	}
	_ = server.SetReadDeadline(time.Time{})
	p.Resume()
	got := make([]byte, 2)
	if _, err := io.ReadFull(server, got); err != nil || got[0] != 2 || got[1] != 3 {
		t.Fatalf("after the resume: read %v, %v; want [2 3]", got, err)
	}
	roundTrip(4)

	p.Reset()
	_ = server.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := server.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("after Reset: %v; want the connection ended", err)
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}
