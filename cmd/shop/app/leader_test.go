package app

import (
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/database"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/proof/poll"
)

// One copy at a time holds the reconciler's lock; another takes it when
// the holder lets go, or loses its connection.
func TestOneCopyAtATimeHoldsTheReconcilersLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	key := rand.Int64()
	a := &leader{url: pgtest.URL(), key: key, log: log}
	b := &leader{url: pgtest.URL(), key: key, log: log}
	defer a.release()
	defer b.release()
	if !a.hold(ctx) || b.hold(ctx) {
		t.Fatal("want a to hold the lock and b to stand by")
	}
	if !a.hold(ctx) {
		t.Fatal("the holder lost the lock on its own")
	}
	a.release()
	if !b.hold(ctx) || a.hold(ctx) {
		t.Fatal("after a let go, want b to hold the lock and a to stand by")
	}
	// The holder's connection is lost (its process died, the network cut
	// it): the lock goes with the session.
	var pid int
	if err := b.conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	admin, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, time.Minute, "a to take the lock of b's lost session", func() bool { return a.hold(ctx) })
	if b.hold(ctx) {
		t.Fatal("b still says it holds the lock")
	}
}

// The repair runs wherever the order service does, not only in `shop
// all`: a lone `shop order` process (the others run elsewhere) takes the
// reconciler's lock once the copy that held it lets go, and repairs, here
// a dead event that a missing stream killed in payment's outbox.
func TestALoneOrderServiceRunsTheRepair(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := pgtest.CreateDatabase(ctx, "shop_repair_")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Drop(context.Background()) })
	ns := natstest.New(t)
	addr := freeAddr(t)
	env := map[string]string{"DATABASE_URL": db.URL, "NATS_URL": ns.URL(), "RECONCILE_INTERVAL": "100ms", "ORDER_ADDR": addr}
	cfg, err := LoadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, e := range cfg.Registry { // the other services ran their migrations elsewhere
		if err := Migrate(ctx, db.URL, e, log); err != nil {
			t.Fatal(err)
		}
	}
	payment, err := database.NewPool(ctx, db.URL, "payment", 2)
	if err != nil {
		t.Fatal(err)
	}
	defer payment.Close()
	killed := uuid.Must(uuid.NewV7())
	if _, err := payment.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
		schema_version, subject, payload, dead_at, attempts, last_error)
		VALUES ($1, 'order', 'o-1', 1, 'PaymentSucceeded', 1, 'payment.o-1.PaymentSucceeded', '{}', now(), 1,
		        'no stream for subject "payment.o-1.PaymentSucceeded": nats: no response from stream')`, killed); err != nil {
		t.Fatal(err)
	}
	// Another copy holds the lock first.
	other := &leader{url: db.URL, key: reconcileLockKey(cfg), log: log}
	if !other.hold(ctx) {
		t.Fatal("the other copy could not take the free lock")
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- Run(runCtx, cfg, []string{"order"}, log) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("shop order: %v", err)
		}
	})
	wait, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := httpx.WaitReady(wait, nil, "http://"+addr); err != nil {
		t.Fatal(err)
	}
	other.release()
	poll.Until(t, time.Minute, "the dead event requeued by the order process's reconciler", func() bool {
		rec, err := outbox.Get(ctx, payment, killed)
		return err == nil && rec.DeadAt == nil
	})
	poll.Until(t, time.Minute, "the order service to report it runs the reconciler", func() bool {
		return strings.Contains(get200(t, "http://"+addr+"/metrics"), "shop_reconcile_leader 1")
	})
}
