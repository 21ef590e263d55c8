package broker_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/proof/natstest"
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

// Drift compares every field of a stream's configuration, whichever
// nats.go adds: each one changed alone is named, and nothing else is.
func TestDriftNamesEveryField(t *testing.T) {
	t.Parallel()
	want := broker.StreamConfig("ORDERS", 1, broker.DefaultLimits, "orders.>")
	typ := reflect.TypeFor[jetstream.StreamConfig]()
	for i := range typ.NumField() {
		field := typ.Field(i).Name
		have := want
		change(reflect.ValueOf(&have).Elem().Field(i))
		got := broker.Drift(have, want)
		if field == "Metadata" {
			// The server's own keys are not drift; anyone else's is.
			have.Metadata = map[string]string{"_nats.ver": "2.15.3", "_nats.req.level": "0"}
			if d := broker.Drift(have, want); len(d) != 0 {
				t.Errorf("the server's metadata is drift: %v", d)
			}
		}
		if len(got) != 1 || got[0].Field != field {
			t.Errorf("%s changed: drift %v, want it alone", field, got)
		}
	}
	if d := broker.Drift(want, want); d != nil {
		t.Errorf("no change: drift %v", d)
	}
	same := want
	same.Subjects, same.Sources = slices.Clone(want.Subjects), []*jetstream.StreamSource{} // empty is no source
	if d := broker.Drift(same, want); d != nil {
		t.Errorf("an empty list for none: drift %v", d)
	}
}

// change sets v to a value other than the one it has.
func change(v reflect.Value) {
	switch v.Kind() {
	case reflect.Bool:
		v.SetBool(!v.Bool())
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(v.Int() + 1)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(v.Uint() + 1)
	case reflect.String:
		v.SetString(v.String() + "x")
	case reflect.Slice:
		v.Set(reflect.Append(v, reflect.New(v.Type().Elem()).Elem()))
	case reflect.Map:
		m := reflect.MakeMap(v.Type())
		m.SetMapIndex(reflect.ValueOf("owner"), reflect.ValueOf("someone"))
		v.Set(m)
	case reflect.Pointer:
		if v.IsNil() {
			v.Set(reflect.New(v.Type().Elem()))
		} else {
			v.SetZero()
		}
	case reflect.Struct:
		change(v.Field(0))
	default:
		panic("change: " + v.Kind().String())
	}
}

// The shop's configuration holds even against a user who may do anything:
// no message is deleted or purged, no rollup allowed, and none of it can
// be switched off.
func TestStreamConfigDeniesDeletesPurgesAndRollups(t *testing.T) {
	t.Parallel()
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	ctx := context.Background()
	want := broker.StreamConfig("ORDERS", 1, broker.DefaultLimits, "orders.>")
	st, err := js.CreateStream(ctx, want)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, err := js.Publish(ctx, "orders.o-1.Step", nil, jetstream.WithMsgID(fmt.Sprint("m-", i))); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.DeleteMsg(ctx, 1); err == nil {
		t.Error("a message was deleted")
	}
	if err := st.Purge(ctx); err == nil {
		t.Error("the stream was purged")
	}
	rollup := nats.NewMsg("orders.o-1.Step")
	rollup.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupAll)
	if _, err := js.PublishMsg(ctx, rollup); err == nil {
		t.Error("a rollup was stored")
	}
	for name, tamper := range map[string]func(*jetstream.StreamConfig){
		"AllowRollup": func(c *jetstream.StreamConfig) { c.AllowRollup = true },
		"DenyDelete":  func(c *jetstream.StreamConfig) { c.DenyDelete = false },
		"DenyPurge":   func(c *jetstream.StreamConfig) { c.DenyPurge = false },
	} {
		c := want
		tamper(&c)
		if _, err := js.UpdateStream(ctx, c); err == nil {
			t.Errorf("%s changed", name)
		}
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 3 || len(broker.Drift(info.Config, want)) != 0 {
		t.Errorf("%d messages, drift %v; want 3 and none", info.State.Msgs, broker.Drift(info.Config, want))
	}
}
