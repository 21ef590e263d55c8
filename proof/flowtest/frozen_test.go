package flowtest

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/logbuf"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgcluster"
	"github.com/shop-ref/shop/proof/poll"
)

// relayProcessEnv makes the test binary a relay process
// (TestRelayProcess): its value is the relay's configuration, as JSON.
const relayProcessEnv = "FLOWTEST_RELAY_PROCESS"

// relayProcess is what a relay process is told.
type relayProcess struct {
	DatabaseURL, Schema, NATSURL, Name string
	HandOff                            time.Duration
}

// TestRelayProcess is not a test: it is the body of a relay process that
// another test starts (startRelayProcess), so that it can freeze or kill
// a relay alone. It runs a ModeCDC relay until it is killed.
func TestRelayProcess(t *testing.T) {
	spec := os.Getenv(relayProcessEnv)
	if spec == "" {
		t.Skip("a relay process for other tests of this package")
	}
	var p relayProcess
	if err := json.Unmarshal([]byte(spec), &p); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pool, err := database.NewPool(ctx, p.DatabaseURL, p.Schema, 6)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(p.NATSURL, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(pool, js, outbox.Config{Name: p.Name, Mode: outbox.ModeCDC, HandOff: p.HandOff,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	if err != nil {
		t.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil {
		t.Fatal(err)
	}
}

// startRelayProcess starts a relay process; it is killed when the test
// ends, frozen or not. Its log goes to the returned builder.
func startRelayProcess(t *testing.T, p relayProcess) (*exec.Cmd, *logbuf.Buffer) {
	t.Helper()
	spec, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestRelayProcess$", "-test.count=1", "-test.timeout=0")
	cmd.Env = append(os.Environ(), relayProcessEnv+"="+string(spec))
	logs := &logbuf.Buffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	// Pdeathsig: a test binary killed without its cleanups takes its
	// relay processes with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT) // a stopped process does not die of SIGKILL until continued on some kernels
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("relay process %s:\n%s", p.Name, logs.String())
		}
	})
	return cmd, logs
}

// TestCDCFrozenStreamerIsTakenOver: the process that streams the slot is
// frozen (SIGSTOP: alive to the kernel, its sockets open, answering
// nothing), with a standby relay beside it. Postgres keeps the slot
// active while the frozen process's walsender lives, which by default is
// until wal_sender_timeout (60 s) has passed; every event meanwhile
// waits, here for good (an hour's HandOff: only a stream publishes). The
// standby must take the slot over within seconds, and once the frozen
// process wakes up, nothing is lost, stored twice or out of order.
func TestCDCFrozenStreamerIsTakenOver(t *testing.T) {
	t.Parallel()
	const aggregates = 8
	pg := pgcluster.Start(t, nil)
	pool := privateSchema(t, pg, "producer", 6)
	srv := natstest.New(t)
	nc, js := srv.Connect(t)
	srv.Stream(t, js, "EV", "ev.>")
	ctx := context.Background()

	// What reaches the broker: the highest writer index stored so far.
	var newest atomic.Int64
	newest.Store(-1)
	sub, err := nc.Subscribe("ev.>", func(m *nats.Msg) {
		var p struct{ I int64 }
		if json.Unmarshal(m.Data, &p) == nil {
			for {
				old := newest.Load()
				if p.I <= old || newest.CompareAndSwap(old, p.I) {
					break
				}
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	// The streamer is a process of its own, so that it can be frozen.
	frozen, _ := startRelayProcess(t, relayProcess{DatabaseURL: pg.URL(), Schema: "producer", NATSURL: srv.URL(),
		Name: "frozen", HandOff: time.Hour})
	slotActive := func() bool {
		var active bool
		err := pool.QueryRow(ctx, `SELECT coalesce(bool_or(active), false) FROM pg_replication_slots`).Scan(&active)
		return err == nil && active
	}
	poll.Until(t, time.Minute, "the relay process streams the slot", slotActive)

	// The standby, in this process, with the defaults that matter here
	// (PollInterval, how often it tries the slot).
	logs := &records{level: slog.LevelWarn}
	standby, err := outbox.NewRelay(pool, js, outbox.Config{Name: "standby", Mode: outbox.ModeCDC, HandOff: time.Hour, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "standby relay", standby.Run)

	// A writer commits an event every 20 ms, each with its index.
	var written atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		var w outbox.Writer
		for i := int64(0); ; i++ {
			agg := fmt.Sprintf("a-%d", i%aggregates)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return w.Add(ctx, tx, outbox.Event{AggregateType: "order", AggregateID: agg, Type: "Step",
					Subject: "ev." + agg + ".Step", Payload: map[string]int64{"i": i}})
			})
			if err != nil {
				t.Errorf("write event %d: %v", i, err)
				return
			}
			written.Store(i)
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond): // the writer's pace, not a wait for a condition
			}
		}
	})
	stopWriter := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopWriter()
	poll.Until(t, 30*time.Second, "events flow through the relay process", func() bool { return newest.Load() >= 20 })
	if standby.State().Streaming {
		t.Fatal("the standby streams before the freeze")
	}

	if err := frozen.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozenAt, mark := time.Now(), written.Load()
	poll.Until(t, frozenTakeoverWait, "an event committed after the freeze in the stream", func() bool { return newest.Load() > mark })
	took := time.Since(frozenAt)
	if !standby.State().Streaming {
		t.Error("events flow again, but the standby does not say it streams")
	}
	how := "its walsender's wal_sender_timeout"
	if logs.has("WARN outbox relay: the relay streaming the slot stopped saying it is alive; ended its stream") {
		how = "the standby, which ended its walsender"
	}
	t.Logf("the frozen streamer's slot taken over by %s: events committed after the freeze stored %v after it",
		how, took.Round(10*time.Millisecond))

	// The frozen process wakes up, to find its stream ended.
	if err := frozen.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	woke := written.Load()
	poll.Until(t, 30*time.Second, "more events stored after the wake-up", func() bool { return newest.Load() > woke+25 })
	stopWriter()
	poll.Until(t, time.Minute, "every committed event published", func() bool {
		st, err := outbox.ReadStats(ctx, pool)
		return err == nil && st.Pending == 0 && st.Dead == 0
	})
	requireAllInStream(t, pool, js, "EV")
	_, seqs := streamIDs(t, js, "EV")
	for agg, s := range seqs {
		for i := range s {
			if s[i] != int64(i+1) {
				t.Errorf("aggregate %s in the stream in the order %v", agg, s)
				break
			}
		}
	}
}

// frozenTakeoverWait bounds the wait for the takeover: well under the 60 s
// of Postgres's default wal_sender_timeout, which ended the frozen
// stream before the standby could take over (59 s measured then; about
// 4 s since).
const frozenTakeoverWait = 20 * time.Second

// TestPollingRelayWarnsOfItsLeftoverSlot: a service switched from cdc to
// poll leaves its slot, which no relay confirms any more and which keeps
// WAL (and Postgres from starting with wal_level below logical). Its
// relay, polling, warns of it with the command that drops it; once
// dropped, the slot stays gone.
func TestPollingRelayWarnsOfItsLeftoverSlot(t *testing.T) {
	t.Parallel()
	pg := pgcluster.Start(t, nil)
	pool := privateSchema(t, pg, "producer", 6)
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	ctx := context.Background()

	cdc, err := outbox.NewRelay(pool, js, outbox.Config{Mode: outbox.ModeCDC, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stopCDC := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- cdc.Run(runCtx) }()
	poll.Until(t, 30*time.Second, "the cdc relay streams", func() bool { return cdc.State().Streaming })
	stopCDC()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	logs := &records{level: slog.LevelWarn}
	polling, err := outbox.NewRelay(pool, js, outbox.Config{Mode: outbox.ModePoll, SlotDropHint: "shop slots drop --service producer",
		Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "polling relay", polling.Run)
	poll.Until(t, 30*time.Second, "the polling relay to warn of its slot", func() bool {
		return logs.has("WARN outbox relay: the relay polls, but its replication slot from cdc mode is still there, " +
			"holding WAL that no relay will confirm; drop it: shop slots drop --service producer")
	})
	st, err := outbox.ReadSlot(ctx, pool, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := outbox.DropSlot(ctx, pool, st.Slot); err != nil {
		t.Fatal(err)
	}
	if st, err := outbox.ReadSlot(ctx, pool, ""); err != nil || st.Exists || st.Publication {
		t.Errorf("after the drop: %+v (%v), want no slot and no publication", st, err)
	}
}
