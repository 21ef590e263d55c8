// Package pgcluster starts a private, throwaway Postgres cluster for one
// test or one chaos run: initdb into a temporary directory with the
// binaries of the installed server, a postmaster on a free port of
// 127.0.0.1 with trust authentication and logical replication on.
//
// It exists for the failure windows that need the server itself to fail:
// a Postgres restart (fast, or immediate: a crash as far as the data is
// concerned), a replication slot invalidated by max_slot_wal_keep_size
// (a cluster-wide setting), anything else that must not be done to the
// machine's Postgres, which other tests share. Everything else uses
// proof/pgtest's schema on the shared server, which is far cheaper.
//
// initdb and postgres refuse to run as root: when the test runs as root
// (CI does) the cluster's processes run as the "postgres" OS user and its
// directory is theirs; otherwise they run as the current user. The
// cluster's superuser is "postgres" either way. The cluster is stopped and
// its directory removed when the test ends; only the postmaster this
// package started is ever signalled, by its PID.
package pgcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Mode is how the server is stopped, as pg_ctl stop -m names it.
type Mode string

const (
	// Fast: clients are disconnected, the server checkpoints and writes
	// every replication slot's state before it exits (SIGINT).
	Fast Mode = "fast"
	// Immediate: every process quits at once, with no checkpoint; the
	// next start recovers from the WAL, as after a crash (SIGQUIT). A
	// logical slot's confirmed position is written only at checkpoints,
	// so it comes back as of the last one: a client streams again what it
	// had already confirmed since.
	Immediate Mode = "immediate"
)

// signal is what pg_ctl stop -m sends the postmaster for mode.
func (m Mode) signal() (syscall.Signal, error) {
	switch m {
	case Fast:
		return syscall.SIGINT, nil
	case Immediate:
		return syscall.SIGQUIT, nil
	}
	return 0, fmt.Errorf("pgcluster: unknown stop mode %q (want %q or %q)", m, Fast, Immediate)
}

// Cluster is a private Postgres server.
type Cluster struct {
	dir      string // the temporary directory: data/, the log
	data     string
	bin      string // the server's bin directory
	port     int
	settings map[string]string
	cred     *syscall.Credential // nil: run as the current user

	mu     sync.Mutex
	cmd    *exec.Cmd     // the running postmaster; nil when stopped
	exited chan struct{} // closed when cmd has exited
}

// defaults are the settings every cluster runs with, before the
// caller's: what ModeCDC needs, and no fsync (a throwaway cluster need not
// survive the machine crashing; a postmaster's crash it survives without).
func defaults() map[string]string {
	return map[string]string{
		"wal_level":             "logical",
		"max_replication_slots": "16",
		"max_wal_senders":       "16",
		"max_connections":       "60",
		"fsync":                 "off",
		"full_page_writes":      "off",
		"shared_buffers":        "32MB",
	}
}

// Start makes and starts a cluster for t with wal_level=logical, 16
// replication slots and WAL senders, 60 connections and fsync off,
// overridden and extended by settings (e.g. "max_slot_wal_keep_size":
// "1MB"); it is stopped and removed when t ends.
func Start(t testing.TB, settings map[string]string) *Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := New(ctx, settings)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	return c
}

// New makes and starts a cluster; the caller must Close it.
func New(ctx context.Context, settings map[string]string) (*Cluster, error) {
	bin, err := serverBin()
	if err != nil {
		return nil, err
	}
	c := &Cluster{bin: bin, settings: defaults()}
	for k, v := range settings {
		c.settings[k] = v
	}
	uid, gid := -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("pgcluster: running as root, and initdb refuses root: need the postgres OS user: %w", err)
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		c.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}
	}
	// Not t.TempDir: its parent is root's and 0700, which the postgres
	// user cannot enter.
	if c.dir, err = os.MkdirTemp("", "pgcluster-"); err != nil {
		return nil, fmt.Errorf("pgcluster: %w", err)
	}
	if c.cred != nil {
		if err := os.Chown(c.dir, uid, gid); err != nil {
			os.RemoveAll(c.dir)
			return nil, fmt.Errorf("pgcluster: give %s to postgres: %w", c.dir, err)
		}
	}
	c.data = filepath.Join(c.dir, "data")
	if err := c.initdb(ctx); err != nil {
		os.RemoveAll(c.dir)
		return nil, err
	}
	// A free port can be taken between our probe and the postmaster's
	// bind; then try another.
	for try := 0; ; try++ {
		if c.port, err = freePort(); err == nil {
			err = c.Start(ctx)
		}
		if err == nil {
			return c, nil
		}
		if try == 2 || ctx.Err() != nil || !strings.Contains(err.Error(), "could not bind") {
			os.RemoveAll(c.dir)
			return nil, err
		}
	}
}

// serverBin finds the bin directory of the newest installed server
// (/usr/lib/postgresql/<version>/bin), or of the pg_config on PATH.
func serverBin() (string, error) {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return vi > vj
	})
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		d := strings.TrimSpace(string(out))
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("pgcluster: no Postgres server installed (no /usr/lib/postgresql/*/bin/initdb, no pg_config on PATH)")
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgcluster: free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// command runs one of the server's programs as the cluster's user.
func (c *Cluster) command(ctx context.Context, prog string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(c.bin, prog), args...)
	cmd.Dir = c.dir
	// Pdeathsig: a test binary killed without its cleanups (a -timeout
	// panic) takes its postmaster with it. Go sets it after the
	// credentials, which would clear it otherwise.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGKILL}
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C", "TZ=UTC"}
	return cmd
}

func (c *Cluster) initdb(ctx context.Context) error {
	cmd := c.command(ctx, "initdb", "-D", c.data, "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-sync")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pgcluster: initdb: %w\n%s", err, out)
	}
	return nil
}

// URL connects to the cluster's "postgres" database as its superuser.
func (c *Cluster) URL() string { return c.DatabaseURL("postgres") }

// DatabaseURL connects to database on the cluster as its superuser.
func (c *Cluster) DatabaseURL(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", c.port, database)
}

// Port is the cluster's TCP port on 127.0.0.1.
func (c *Cluster) Port() int { return c.port }

// LogPath is the server's log (stdout and stderr), kept across restarts.
func (c *Cluster) LogPath() string { return filepath.Join(c.dir, "postgres.log") }

// Start starts the stopped server and waits until it takes connections.
func (c *Cluster) Start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd != nil {
		return errors.New("pgcluster: already running")
	}
	args := []string{"-D", c.data, "-p", strconv.Itoa(c.port),
		"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="}
	keys := make([]string, 0, len(c.settings))
	for k := range c.settings {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		args = append(args, "-c", k+"="+c.settings[k])
	}
	f, err := os.OpenFile(c.LogPath(), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("pgcluster: %w", err)
	}
	// Not CommandContext: the server outlives the context of its start.
	cmd := c.command(context.Background(), "postgres", args...)
	cmd.Stdout, cmd.Stderr = f, f
	mark, _ := f.Seek(0, 2)
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("pgcluster: start postgres: %w", err)
	}
	c.cmd, c.exited = cmd, make(chan struct{})
	exited := c.exited
	go func() {
		_ = cmd.Wait() // how it ended is in the log
		f.Close()
		close(exited)
	}()
	if err := c.waitReady(ctx, exited); err != nil {
		c.killLocked()
		return fmt.Errorf("pgcluster: postgres did not start: %w\n%s", err, c.logSince(mark))
	}
	return nil
}

// waitReady waits until the server answers a query, or exits.
func (c *Cluster) waitReady(ctx context.Context, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, c.URL())
		if err == nil {
			err = conn.Ping(ctx)
			conn.Close(context.Background())
			if err == nil {
				return nil
			}
		}
		select {
		case <-exited:
			return errors.New("postgres exited")
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// logSince returns the server's log from byte offset on, for errors.
func (c *Cluster) logSince(offset int64) string {
	b, err := os.ReadFile(c.LogPath())
	if err != nil || offset > int64(len(b)) {
		return ""
	}
	return string(bytes.TrimSpace(b[offset:]))
}

// Stop stops the server as pg_ctl stop -m mode does, and waits until the
// postmaster has exited. Stopping a stopped server is no error.
func (c *Cluster) Stop(ctx context.Context, mode Mode) error {
	sig, err := mode.signal()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd == nil {
		return nil
	}
	if err := c.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("pgcluster: signal postgres %d: %w", c.cmd.Process.Pid, err)
	}
	select {
	case <-c.exited:
	case <-ctx.Done():
		c.killLocked()
		return fmt.Errorf("pgcluster: stop -m %s: %w; killed", mode, ctx.Err())
	}
	c.closeLocked()
	return nil
}

// Configure changes settings for the server's next Start (a Restart, say):
// wal_level, which Postgres reads only when it starts. An empty value
// removes a setting from the postmaster's command line, which wins over
// the configuration files: the server then takes it from them (ALTER
// SYSTEM), or its default.
func (c *Cluster) Configure(settings map[string]string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, v := range settings {
		if v == "" {
			delete(c.settings, k)
		} else {
			c.settings[k] = v
		}
	}
}

// Restart stops the server with mode and starts it again; clients see
// their connections end and new ones refused until it is back.
func (c *Cluster) Restart(ctx context.Context, mode Mode) error {
	if err := c.Stop(ctx, mode); err != nil {
		return err
	}
	return c.Start(ctx)
}

// killLocked SIGKILLs the postmaster this cluster started and waits for
// it; its backends exit on noticing their postmaster gone. c.mu is held.
func (c *Cluster) killLocked() {
	if c.cmd == nil {
		return
	}
	_ = c.cmd.Process.Kill()
	<-c.exited
	c.closeLocked()
}

func (c *Cluster) closeLocked() { c.cmd = nil }

// Close stops the server (fast; immediate after 30s) and removes its
// directory.
func (c *Cluster) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := c.Stop(ctx, Fast)
	if err != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err = errors.Join(err, c.Stop(ctx, Immediate))
	}
	if rerr := os.RemoveAll(c.dir); rerr != nil {
		err = errors.Join(err, fmt.Errorf("pgcluster: remove %s: %w", c.dir, rerr))
	}
	return err
}
