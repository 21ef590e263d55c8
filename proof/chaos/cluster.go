package chaos

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/registry"
)

// cluster is the run's NATS: n separate nats-server processes (3, or 1 for
// the single-node run) built from the module go.mod requires, clustered
// over routes, JetStream on, each with a store of its own, every port a
// free one of 127.0.0.1. The harness starts and signals them by PID; one
// that exits on its own is recorded and started again.
type cluster struct {
	t     testing.TB
	bin   string
	nodes []*node
	// passwords are the NATS users' (broker.Users and adminUser), made for
	// the run: every node requires them, as deploy/nats/auth.conf does.
	passwords map[string]string
	// access is what each of the shop's NATS users may do, for every
	// node's configuration.
	access []broker.Access
	// nc is the harness's admin connection, straight to every node's client
	// port (never through the shop's proxies), for the JetStream API.
	nc   *nats.Conn
	js   jetstream.JetStream
	http *http.Client

	mu        sync.Mutex
	selfExits []Exit
	stopping  bool
	watchers  sync.WaitGroup
}

// node is one nats-server process.
type node struct {
	c                           *cluster
	name                        string // n1, n2, n3: its server_name
	port, clusterPort, httpPort int
	dir                         string // store/, nats.conf and one log per start

	mu        sync.Mutex
	cmd       *exec.Cmd
	gen       int
	exited    chan struct{}
	running   bool
	signalled bool // the harness stopped it: its exit is no surprise
	jsOff     bool // JetStream disabled in its configuration
}

// newCluster starts n nodes and waits until JetStream is up on all of
// them. t.Cleanup stops them.
func newCluster(ctx context.Context, t testing.TB, bin, dir string, n int, reg registry.Registry) *cluster {
	c := &cluster{t: t, bin: bin, access: reg.Access(), http: &http.Client{Timeout: 2 * time.Second}, passwords: map[string]string{adminUser: rand.Text()}}
	for _, name := range reg.Names() {
		c.passwords[name] = rand.Text()
	}
	c.passwords[broker.AuditUser] = rand.Text()
	c.passwords[broker.StreamsUser] = rand.Text()
	for i := 1; i <= n; i++ {
		nd := &node{c: c, name: fmt.Sprintf("n%d", i), dir: filepath.Join(dir, fmt.Sprintf("n%d", i)),
			port: freePort(t), clusterPort: freePort(t), httpPort: freePort(t)}
		if err := os.MkdirAll(nd.dir, 0o755); err != nil {
			t.Fatal(err)
		}
		c.nodes = append(c.nodes, nd)
	}
	t.Cleanup(c.stop)
	for _, nd := range c.nodes {
		if err := nd.start(); err != nil {
			t.Fatalf("start nats %s: %v", nd.name, err)
		}
	}
	if err := c.waitHealthy(ctx, time.Minute); err != nil {
		t.Fatalf("nats cluster: %v", err)
	}
	urls := make([]string, len(c.nodes))
	for i, nd := range c.nodes {
		urls[i] = nd.url()
	}
	nc, err := c.connect(adminUser)
	if err != nil {
		t.Fatalf("admin connection to nats: %v", err)
	}
	c.nc = nc
	if c.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	return c
}

// adminUser is the harness's own NATS user, with every permission: it
// injects faults (deletes consumers, reads any state). The shop's processes
// and the hostile lane connect as the shop's users.
const adminUser = "chaos-admin"

// connect connects as user straight to every node (never through the
// shop's proxies), reconnecting for ever; t.Cleanup closes it.
func (c *cluster) connect(user string) (*nats.Conn, error) {
	urls := make([]string, len(c.nodes))
	for i, nd := range c.nodes {
		urls[i] = nd.url()
	}
	nc, err := nats.Connect(strings.Join(urls, ","), append(broker.UserOptions(user, c.passwords[user]), nats.Name("chaos "+user),
		nats.MaxReconnects(-1), nats.ReconnectWait(200*time.Millisecond))...)
	if err != nil {
		return nil, err
	}
	c.t.Cleanup(nc.Close)
	return nc, nil
}

func (nd *node) url() string  { return fmt.Sprintf("nats://127.0.0.1:%d", nd.port) }
func (nd *node) addr() string { return fmt.Sprintf("127.0.0.1:%d", nd.port) }

// config is the node's configuration file. Routes list every node (a
// server skips its own). no_advertise keeps the servers from telling
// clients each other's real addresses, which would let a shop process's
// client reconnect around its proxies.
func (nd *node) config() string {
	var b strings.Builder
	fmt.Fprintf(&b, "server_name: %s\nlisten: %s\nhttp: 127.0.0.1:%d\n", nd.name, nd.addr(), nd.httpPort)
	// As deploy/nats/cluster.conf: fsync before every acknowledgement, so
	// that a killed node loses nothing it acknowledged (internal/broker).
	fmt.Fprintf(&b, "jetstream {\n  store_dir: %q\n  enabled: %t\n  sync_interval: always\n}\n", filepath.Join(nd.dir, "store"), !nd.jsOff)
	// The shop's users, as deploy/nats/auth.conf has them, and the harness's.
	b.WriteString(broker.AuthConfig(nd.c.access, func(user string) string { return strconv.Quote(nd.c.passwords[user]) },
		&server.User{Username: adminUser, Password: nd.c.passwords[adminUser]}))
	if len(nd.c.nodes) > 1 {
		routes := make([]string, len(nd.c.nodes))
		for i, o := range nd.c.nodes {
			routes[i] = fmt.Sprintf("nats-route://127.0.0.1:%d", o.clusterPort)
		}
		fmt.Fprintf(&b, "cluster {\n  name: chaos\n  listen: 127.0.0.1:%d\n  no_advertise: true\n  routes: [%s]\n}\n",
			nd.clusterPort, strings.Join(routes, ", "))
	}
	return b.String()
}

func (nd *node) writeConfig() error {
	return os.WriteFile(filepath.Join(nd.dir, "nats.conf"), []byte(nd.config()), 0o644)
}

// start starts the node's process and a watcher that records an exit the
// harness did not cause and starts the node again.
func (nd *node) start() error {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	nd.c.mu.Lock()
	stopping := nd.c.stopping
	nd.c.mu.Unlock()
	if nd.running || stopping { // stopping: the cleanup has stopped it, or is about to
		return nil
	}
	if err := nd.writeConfig(); err != nil {
		return err
	}
	nd.gen++
	logPath := filepath.Join(nd.dir, fmt.Sprintf("nats-%03d.log", nd.gen))
	f, err := os.Create(logPath)
	if err != nil {
		return err
	}
	cmd := exec.Command(nd.c.bin, "-c", filepath.Join(nd.dir, "nats.conf"))
	cmd.SysProcAttr = orphanKill()
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return err
	}
	exited := make(chan struct{})
	nd.cmd, nd.exited, nd.running, nd.signalled = cmd, exited, true, false
	nd.c.watchers.Add(1)
	go func() {
		defer nd.c.watchers.Done()
		werr := cmd.Wait()
		f.Close()
		nd.mu.Lock()
		nd.running = false
		surprise := !nd.signalled
		nd.mu.Unlock()
		close(exited)
		if !surprise {
			return
		}
		nd.c.mu.Lock()
		stopping := nd.c.stopping
		if !stopping {
			nd.c.selfExits = append(nd.c.selfExits, Exit{Who: "nats " + nd.name, Gen: nd.gen,
				At: time.Now(), Status: fmt.Sprint(werr), Tail: tail(logPath, 15)})
		}
		nd.c.mu.Unlock()
		if !stopping {
			time.Sleep(time.Second)
			_ = nd.start()
		}
	}()
	return nil
}

// stop sends sig (SIGKILL or SIGTERM) and waits until the process is gone;
// a SIGTERM not obeyed in 15s becomes a SIGKILL.
func (nd *node) stop(sig syscall.Signal) {
	nd.mu.Lock()
	cmd, exited, running := nd.cmd, nd.exited, nd.running
	if running {
		nd.signalled = true
		_ = cmd.Process.Signal(sig)
	}
	nd.mu.Unlock()
	if !running {
		return
	}
	select {
	case <-exited:
	case <-time.After(15 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
	}
}

// setJetStream rewrites the node's configuration with JetStream enabled or
// disabled and makes it reload (SIGHUP, as `nats-server --signal reload`
// does): nats-server 2.15 applies `enabled: false` on reload by shutting
// JetStream down on that node while its core NATS (clients, routes) stays
// up, and `enabled: true` by starting JetStream again, which rejoins the
// meta group and catches its replicas up. It waits until the node's /jsz
// says so.
func (nd *node) setJetStream(ctx context.Context, on bool) error {
	nd.mu.Lock()
	nd.jsOff = !on
	err := nd.writeConfig()
	if err == nil && nd.running {
		err = nd.cmd.Process.Signal(syscall.SIGHUP)
	}
	nd.mu.Unlock()
	if err != nil {
		return fmt.Errorf("reload %s: %w", nd.name, err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		var jsz struct {
			Disabled bool `json:"disabled"`
		}
		if err := nd.c.get(ctx, nd.httpPort, "/jsz", &jsz); err == nil && jsz.Disabled == !on {
			return nil
		}
		if !sleepCtx(ctx, 100*time.Millisecond) {
			return fmt.Errorf("%s: JetStream enabled=%t not confirmed by /jsz within 30s", nd.name, on)
		}
	}
}

// get reads a monitoring endpoint of the node on port as JSON.
func (c *cluster) get(ctx context.Context, port int, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d%s", port, path), nil)
	if err != nil {
		return err
	}
	res, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", path, res.Status)
	}
	if v == nil {
		return nil
	}
	return json.NewDecoder(res.Body).Decode(v)
}

// waitHealthy waits until every node answers /healthz with 200, which a
// JetStream node does once it is current with the meta group and its
// streams.
func (c *cluster) waitHealthy(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, nd := range c.nodes {
		for {
			err := c.get(ctx, nd.httpPort, "/healthz", nil)
			if err == nil {
				break
			}
			if !sleepCtx(ctx, 200*time.Millisecond) {
				return fmt.Errorf("%s not healthy after %v: %w", nd.name, timeout, err)
			}
		}
	}
	return nil
}

// streamLeader is the node that leads stream, from the JetStream API's
// stream info (Cluster.Leader), asking for up to 10s while the stream has
// none (an election after an earlier fault).
func (c *cluster) streamLeader(ctx context.Context, stream string) (*node, error) {
	if len(c.nodes) == 1 {
		return c.nodes[0], nil // it leads everything
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		nd, err := c.leaderOnce(ctx, stream)
		if err == nil || !sleepCtx(ctx, 250*time.Millisecond) {
			return nd, err
		}
	}
}

func (c *cluster) leaderOnce(ctx context.Context, stream string) (*node, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	st, err := c.js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream info %s: %w", stream, err)
	}
	info := st.CachedInfo()
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return nil, fmt.Errorf("stream %s has no leader now", stream)
	}
	for _, nd := range c.nodes {
		if nd.name == info.Cluster.Leader {
			return nd, nil
		}
	}
	return nil, fmt.Errorf("stream %s: leader %q is none of the nodes", stream, info.Cluster.Leader)
}

// deleteConsumer deletes a durable consumer as an operator would.
func (c *cluster) deleteConsumer(ctx context.Context, stream, name string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := c.js.DeleteConsumer(ctx, stream, name); err != nil {
		return fmt.Errorf("delete consumer %s on %s: %w", name, stream, err)
	}
	return nil
}

// hasConsumer tells whether the durable consumer exists.
func (c *cluster) hasConsumer(ctx context.Context, stream, name string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err := c.js.Consumer(ctx, stream, name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return false, nil
	}
	return err == nil, err
}

// exits returns the nodes' exits the harness did not cause.
func (c *cluster) exits() []Exit {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Exit(nil), c.selfExits...)
}

// stop ends every node by PID, SIGTERM first.
func (c *cluster) stop() {
	c.mu.Lock()
	c.stopping = true
	c.mu.Unlock()
	var wg sync.WaitGroup
	for _, nd := range c.nodes {
		wg.Go(func() { nd.stop(syscall.SIGTERM) })
	}
	wg.Wait()
	c.watchers.Wait()
}
