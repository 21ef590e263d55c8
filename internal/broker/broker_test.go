package broker_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/internal/natstest"
)

func TestEnsureStreamCreatesOnceAndUpdatesOnlyWhatDiffers(t *testing.T) {
	t.Parallel()
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	ctx := context.Background()

	first, err := broker.EnsureStream(ctx, js, "ORDERS", 1, "orders.>")
	if err != nil {
		t.Fatal(err)
	}
	created := first.CachedInfo().Created
	again, err := broker.EnsureStream(ctx, js, "ORDERS", 1, "orders.>")
	if err != nil {
		t.Fatal(err)
	}
	if !again.CachedInfo().Created.Equal(created) {
		t.Fatal("ensuring an existing stream recreated it")
	}
	cfg := again.CachedInfo().Config
	if cfg.Duplicates != broker.DuplicateWindow || cfg.Replicas != 1 {
		t.Fatalf("stream config %+v", cfg)
	}

	changed, err := broker.EnsureStream(ctx, js, "ORDERS", 1, "orders.>", "legacy.orders.>")
	if err != nil {
		t.Fatal(err)
	}
	if got := changed.CachedInfo().Config.Subjects; !slices.Equal(got, []string{"orders.>", "legacy.orders.>"}) {
		t.Fatalf("subjects after update: %v", got)
	}
}

// The shop's embedded server fsyncs before every acknowledgement unless told
// otherwise.
func TestEmbeddedSyncsAlwaysByDefault(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		opts     []broker.Option
		always   bool
		interval time.Duration
	}{
		{"default", nil, true, broker.ServerDefaultSyncInterval},
		{"WithSyncAlways", []broker.Option{broker.WithSyncAlways()}, true, broker.ServerDefaultSyncInterval},
		{"WithSyncInterval", []broker.Option{broker.WithSyncInterval(time.Second)}, false, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv, err := broker.Embedded("127.0.0.1", -1, t.TempDir(), tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Shutdown()
			if c := srv.JetStreamConfig(); c.SyncAlways != tc.always || c.SyncInterval != tc.interval {
				t.Errorf("sync always %v every %v, want %v every %v", c.SyncAlways, c.SyncInterval, tc.always, tc.interval)
			}
		})
	}
}
