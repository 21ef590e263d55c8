package chaos

import (
	"net"
	"sync"
	"time"
)

// proxy is the harness's TCP fault proxy: one listener on 127.0.0.1 that
// forwards every connection it accepts to one upstream address (a NATS
// node's client port). Each shop process reaches each node through a proxy
// of its own, so the harness can cut one process off the broker while the
// rest of the shop, and the harness's own admin connection, go on directly.
//
// It is written here rather than taken from github.com/Shopify/toxiproxy/v2
// because the fault that matters most is a silent partition that later
// heals, and toxiproxy has no such toxic: its "timeout" toxic drops the
// bytes it holds on the floor ("Drop the data on the ground", toxics/
// timeout.go), so after the toxic is removed the TCP stream resumes with a
// hole in it, which no real network produces (TCP retransmits) and which
// would make NATS's protocol parser fail instead of the partition heal.
// toxiproxy would also add a module and its dependencies (an HTTP API,
// metrics, a logger) to go.mod for what is about 150 lines here.
//
// Pause stops forwarding in both directions without closing or resetting
// anything: the proxy stops reading, so what the peers send waits in the
// kernel's socket buffers and then in their own send buffers, exactly as
// unacknowledged data waits during a partition, and their TCP stacks see no
// RST or FIN (keep-alive probes are still answered by the kernel, as a
// middle box that only drops would not; no peer here relies on TCP
// keep-alive). Resume forwards what was held. A connection accepted while
// paused is held unconnected until Resume, as a SYN lost in a partition.
// Reset closes every connection with an RST, as a middle box that lost its
// state would.
type proxy struct {
	ln       net.Listener
	upstream string

	mu     sync.Mutex
	open   chan struct{} // closed while traffic passes; a fresh one while paused
	conns  map[net.Conn]struct{}
	closed bool
	done   chan struct{} // closed by Close: nothing waits for a resume after it
}

// newProxy listens on a free port of 127.0.0.1 and forwards to upstream.
func newProxy(upstream string) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proxy{ln: ln, upstream: upstream, open: make(chan struct{}),
		conns: map[net.Conn]struct{}{}, done: make(chan struct{})}
	close(p.open)
	go p.serve()
	return p, nil
}

// URL is the NATS URL a client uses to reach the upstream through p.
func (p *proxy) URL() string { return "nats://" + p.ln.Addr().String() }

func (p *proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		go p.handle(c)
	}
}

// gate returns once traffic may pass, false when the proxy is closed.
func (p *proxy) gate() bool {
	p.mu.Lock()
	open := p.open
	p.mu.Unlock()
	select {
	case <-open:
		return true
	case <-p.done:
		return false
	}
}

// track registers c so that Reset and Close reach it; false when closed.
func (p *proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

func (p *proxy) handle(down net.Conn) {
	if !p.track(down) {
		down.Close()
		return
	}
	defer p.untrack(down)
	if !p.gate() { // a connection attempt during a partition waits for the heal
		return
	}
	up, err := net.DialTimeout("tcp", p.upstream, 2*time.Second)
	if err != nil {
		return // the node is down: the client sees its connection end at once, as a refused one
	}
	if !p.track(up) {
		up.Close()
		return
	}
	defer p.untrack(up)
	var wg sync.WaitGroup
	wg.Go(func() { p.pipe(up, down) })
	wg.Go(func() { p.pipe(down, up) })
	wg.Wait()
}

// pipe copies src to dst until either ends, then ends both. It waits at the
// gate before each read and again before forwarding what it read, so that
// during a pause nothing moves and at most one buffer per direction sits in
// the proxy; an end seen during a pause is passed on only after it, as a
// partitioned peer learns of a close only when the network heals.
func (p *proxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for p.gate() {
		n, err := src.Read(buf)
		if !p.gate() {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	src.Close()
	dst.Close()
}

// Pause starts a silent partition (see proxy).
func (p *proxy) Pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.open:
		p.open = make(chan struct{})
	default: // already paused
	}
}

// Resume heals the partition: what was held is forwarded.
func (p *proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.open:
	default:
		close(p.open)
	}
}

// Reset ends every connection with an RST (both sockets of each); new
// connections are accepted as usual. It returns how many sockets it reset.
func (p *proxy) Reset() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		rst(c)
	}
	return len(p.conns)
}

// Close stops listening and ends every connection.
func (p *proxy) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.done)
	}
	conns := make([]net.Conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	p.ln.Close()
	for _, c := range conns {
		rst(c)
	}
}

// rst closes c with linger 0, which sends an RST instead of a FIN.
func rst(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}
