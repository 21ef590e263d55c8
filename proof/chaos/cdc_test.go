package chaos

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

// The cdc lane SIGKILLs the process that streams a slot, which it finds
// by the pid in the name of the relay that streams it (relayPID of the
// walsender's application_name). A relay with the shop's default name,
// streaming: the lane finds this process.
func TestStreamerNamesItsProcess(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	_, js := natstest.New(t).Connect(t)
	relay, err := outbox.NewRelay(db.Pool, js, outbox.Config{Mode: outbox.ModeCDC, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	})
	h := &harness{admin: db.Pool}
	if err := db.Pool.QueryRow(ctx, `SELECT current_database()`).Scan(&h.dbName); err != nil {
		t.Fatal(err)
	}
	var slot, app string
	poll.Until(t, 30*time.Second, "the relay streams its slot", func() bool {
		slot = relay.State().Slot
		active, err := h.streamers(ctx)
		app = active[slot]
		return err == nil && slot != "" && app != ""
	})
	if pid, ok := relayPID(app); !ok || pid != os.Getpid() {
		t.Fatalf("the walsender of slot %s is named %q: relayPID = %d, %v; want this process, %d", slot, app, pid, ok, os.Getpid())
	}
}
