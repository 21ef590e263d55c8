package broker_test

import (
	"context"
	"slices"
	"testing"

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
