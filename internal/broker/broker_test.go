package broker_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

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

func TestStreamsAreBoundedByDefault(t *testing.T) {
	t.Parallel()
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	ctx := context.Background()
	st, err := broker.EnsureStream(ctx, js, "ORDERS", 1, "orders.>")
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	if cfg.MaxAge != broker.DefaultLimits.MaxAge || cfg.MaxBytes != -1 || cfg.Discard != jetstream.DiscardNew {
		t.Fatalf("default limits: max age %v, max bytes %d, discard %v", cfg.MaxAge, cfg.MaxBytes, cfg.Discard)
	}
	// A byte bound refuses new messages when reached rather than dropping
	// old ones a consumer may not have read yet.
	st, err = broker.EnsureStreamWith(ctx, js, "ORDERS", 1, broker.Limits{MaxAge: time.Hour, MaxBytes: 4096}, "orders.>")
	if err != nil {
		t.Fatal(err)
	}
	var refused error
	for i := range 100 {
		if _, err := js.Publish(ctx, "orders.o.Big", make([]byte, 512), jetstream.WithMsgID(fmt.Sprint("m-", i))); err != nil {
			refused = err
			break
		}
	}
	var apiErr *jetstream.APIError
	if !errors.As(refused, &apiErr) || apiErr.Code != 503 {
		t.Fatalf("publishing into a full stream: %v, want a 503 refusal", refused)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.FirstSeq != 1 {
		t.Errorf("the full stream dropped old messages (first seq %d)", info.State.FirstSeq)
	}
}
