package verify_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services"
	"github.com/shop-ref/shop/services/inventory"
	"github.com/shop-ref/shop/services/order"
	"github.com/shop-ref/shop/services/payment"
)

// The order service's outbox and the ORDERS stream, filled by hand: rows
// marked published, and the messages the relay would have sent for them.
func TestAuditStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	order := pgtest.New(t, order.Registration.Sets()...).Pool
	pools := verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{"order": order}}
	srv := natstest.New(t)
	_, js := srv.Connect(t)
	st := srv.Stream(t, js, "ORDERS", "orders.>")

	// event marks an OrderCreated of a fresh order published ago (a
	// Postgres interval); sent, its message goes to the stream.
	event := func(ago string, sent bool) uuid.UUID {
		t.Helper()
		id, agg := uuid.Must(uuid.NewV7()), uuid.NewString()
		if _, err := order.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
			schema_version, subject, payload, occurred_at, published_at)
			VALUES ($1, 'order', $2, 1, 'OrderCreated', 1, 'orders.' || $2 || '.OrderCreated', '{}',
			        now() - $3::interval, now() - $3::interval)`, id, agg, ago); err != nil {
			t.Fatal(err)
		}
		if sent {
			natstest.Publish(t, js, natstest.Event{ID: id, Prefix: "orders", AggregateType: "order", AggregateID: agg,
				Type: "OrderCreated", Seq: 1, Payload: map[string]string{}}.Msg(t))
		}
		return id
	}
	run := func(cfg verify.AuditConfig) verify.StreamAudit {
		t.Helper()
		cfg.Services = []string{"order"}
		audits, err := verify.AuditStreams(ctx, pools, js, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if len(audits) != 1 || audits[0].Err != nil {
			t.Fatalf("audits = %+v", audits)
		}
		return audits[0]
	}
	lostIDs := func(a verify.StreamAudit) []uuid.UUID {
		var ids []uuid.UUID
		for _, l := range a.Lost {
			ids = append(ids, l.EventID)
		}
		return ids
	}
	window := verify.AuditConfig{Window: 72 * time.Hour}

	t.Run("nothing published, nothing read", func(t *testing.T) {
		if a := run(window); a.Published != 0 || a.Scanned != 0 || len(a.Lost) != 0 {
			t.Fatalf("%+v", a)
		}
	})

	event("1 minute", true)
	lost := event("2 minutes", true)
	event("1 minute", true)
	if err := st.DeleteMsg(ctx, 2); err != nil { // lost's message
		t.Fatal(err)
	}
	event("80 hours", false) // older than the window: retention's business
	event("1 second", false) // inside the grace: left for the next audit

	t.Run("a deleted message is lost, named with its aggregate and seq", func(t *testing.T) {
		a := run(window)
		if got := lostIDs(a); !slices.Equal(got, []uuid.UUID{lost}) {
			t.Fatalf("lost %v, want [%s]; %+v", got, lost, a)
		}
		if a.Published != 3 || a.Scanned != 2 {
			t.Errorf("looked for %d events and read %d messages, want 3 and 2", a.Published, a.Scanned)
		}
		s := a.Lost[0].String()
		for _, want := range []string{"order:", "OrderCreated", lost.String(), "seq 1", "stream ORDERS", a.Lost[0].AggregateID} {
			if !strings.Contains(s, want) {
				t.Errorf("%q lacks %q", s, want)
			}
		}
	})

	t.Run("Newest looks for the newest events only and counts the others", func(t *testing.T) {
		a := run(verify.AuditConfig{Window: 72 * time.Hour, Newest: 2})
		if a.Published != 2 || a.Older != 1 || len(a.Lost) != 0 {
			t.Fatalf("%+v; want the two newest looked for, the lost one (the oldest) counted as older", a)
		}
	})

	t.Run("no consumer is left behind", func(t *testing.T) {
		// Admission control and the consumer metrics list the stream's
		// consumers; the audit's own must be gone when it returns.
		run(window)
		names := st.ConsumerNames(ctx)
		var left []string
		for n := range names.Name() {
			left = append(left, n)
		}
		if names.Err() != nil || len(left) != 0 {
			t.Fatalf("consumers left on ORDERS: %v (%v)", left, names.Err())
		}
	})

	t.Run("the stream's last message deleted: the scan still ends", func(t *testing.T) {
		if err := st.DeleteMsg(ctx, 3); err != nil {
			t.Fatal(err)
		}
		if a := run(window); len(a.Lost) != 2 || a.Scanned != 1 {
			t.Fatalf("lost %d, read %d; want 2 and 1: %+v", len(a.Lost), a.Scanned, a)
		}
	})

	t.Run("no message after the window's start: nothing to wait for", func(t *testing.T) {
		// The database's clock an hour ahead of the broker's: the scan
		// starts after the stream's only message.
		pay := pgtest.New(t, payment.Registration.Sets()...).Pool
		srv.Stream(t, js, "PAYMENT", "payment.>")
		id := uuid.Must(uuid.NewV7())
		natstest.Publish(t, js, natstest.Event{ID: id, Prefix: "payment", AggregateType: "order", AggregateID: "o-1",
			Type: "PaymentSucceeded", Seq: 1, Payload: map[string]string{}}.Msg(t))
		if _, err := pay.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
			schema_version, subject, payload, occurred_at, published_at)
			VALUES ($1, 'order', 'o-1', 1, 'PaymentSucceeded', 1, 'payment.o-1.PaymentSucceeded', '{}',
			        now() + interval '1 hour', now() - interval '1 minute')`, id); err != nil {
			t.Fatal(err)
		}
		audits, err := verify.AuditStreams(ctx, verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{"payment": pay}}, js,
			verify.AuditConfig{Window: time.Hour, Services: []string{"payment"}})
		if err != nil {
			t.Fatal(err)
		}
		if a := audits[0]; a.Err != nil || lostIDs(a) == nil || lostIDs(a)[0] != id || a.Scanned != 0 {
			t.Fatalf("%+v; want %s lost (a clock skew beyond the minute the scan allows), none read", a, id)
		}
	})

	t.Run("a stream that cannot be read is not a pass", func(t *testing.T) {
		inv := pgtest.New(t, inventory.Registration.Sets()...).Pool
		if _, err := inv.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
			schema_version, subject, payload, published_at)
			VALUES (gen_random_uuid(), 'product', 'SKU-1', 1, 'ProductUpdated', 1, 'inventory.SKU-1.ProductUpdated', '{}', now() - interval '1 minute')`); err != nil {
			t.Fatal(err)
		}
		audits, err := verify.AuditStreams(ctx, verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{"inventory": inv}}, js,
			verify.AuditConfig{Window: time.Hour, Services: []string{"inventory"}})
		if err != nil {
			t.Fatal(err)
		}
		if a := audits[0]; a.Err == nil || !strings.Contains(a.Err.Error(), "INVENTORY") || a.Published != 1 {
			t.Fatalf("%+v, want an error naming the missing stream INVENTORY", a)
		}
		every := map[string]*pgxpool.Pool{"order": order, "inventory": inv}
		for _, e := range services.All {
			if every[e.Name] == nil {
				every[e.Name] = pgtest.New(t, e.Sets()...).Pool
			}
		}
		r, err := verify.Run(ctx, verify.Shop{Services: services.All, Pools: every}, time.Hour, verify.WithStreams(js))
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		r.Write(&b)
		if r.OK() || !strings.Contains(b.String(), "inventory: not audited (1 published events unchecked)") {
			t.Fatalf("report:\n%s", b.String())
		}
	})
}

// The audit reads a stream of several direct get batches as the audit
// user, who may create no consumer: every message is read once, a message
// deleted in the middle or at a batch's edge is lost, and the server is
// left as it was. A stream that does not allow direct gets is not a pass,
// and the error says what restores it.
func TestAuditStreamsReadsBatchesAsTheAuditUser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	order := pgtest.New(t, order.Registration.Sets()...).Pool
	pools := verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{"order": order}}
	srv, _ := natstest.NewSecured(t, services.All.Access())
	_, admin := srv.Connect(t)
	_, audit := srv.ConnectAs(t, broker.AuditUser)
	st := srv.Stream(t, admin, "ORDERS", "orders.>")

	const n = 2500 // two full batches and a half
	ids := make([]uuid.UUID, n)
	aggs := make([]string, n)
	for i := range ids {
		ids[i], aggs[i] = uuid.Must(uuid.NewV7()), uuid.NewString()
	}
	if _, err := order.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
		schema_version, subject, payload, occurred_at, published_at)
		SELECT id, 'order', agg, 1, 'OrderCreated', 1, 'orders.' || agg || '.OrderCreated', '{}',
		       now() - interval '1 minute', now() - interval '1 minute'
		FROM unnest($1::uuid[], $2::text[]) AS e(id, agg)`, ids, aggs); err != nil {
		t.Fatal(err)
	}
	natstest.PublishAll(t, admin, n, func(i int) (*nats.Msg, string) {
		return natstest.Event{ID: ids[i], Prefix: "orders", AggregateType: "order", AggregateID: aggs[i],
			Type: "OrderCreated", Seq: 1, Payload: map[string]string{}}.Msg(t), ids[i].String()
	})
	// Sequence i+1 is event i: one lost in the middle of a batch, one
	// where the second batch begins.
	for _, seq := range []uint64{700, 1001} {
		if err := st.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	audits, err := verify.AuditStreams(ctx, pools, audit, verify.AuditConfig{Window: time.Hour, Services: []string{"order"}})
	if err != nil {
		t.Fatal(err)
	}
	a := audits[0]
	var lost []uuid.UUID
	for _, l := range a.Lost {
		lost = append(lost, l.EventID)
	}
	slices.SortFunc(lost, func(x, y uuid.UUID) int { return strings.Compare(x.String(), y.String()) })
	if want := []uuid.UUID{ids[699], ids[1000]}; a.Err != nil || !slices.Equal(lost, want) || a.Scanned != n-2 || a.Published != n {
		t.Fatalf("err %v, lost %v (want %v), read %d of %d published (want %d)", a.Err, lost, want, a.Scanned, a.Published, n-2)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Consumers != 0 {
		t.Errorf("the audit left %d consumers on ORDERS", info.State.Consumers)
	}

	t.Run("without direct get", func(t *testing.T) {
		cfg := info.Config
		cfg.Name, cfg.Subjects, cfg.AllowDirect = "PAYMENT", []string{"payment.>"}, false
		if _, err := admin.CreateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		pay := pgtest.New(t, payment.Registration.Sets()...).Pool
		id := uuid.Must(uuid.NewV7())
		natstest.Publish(t, admin, natstest.Event{ID: id, Prefix: "payment", AggregateType: "order", AggregateID: "o-1",
			Type: "PaymentSucceeded", Seq: 1, Payload: map[string]string{}}.Msg(t))
		if _, err := pay.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_seq, event_type,
			schema_version, subject, payload, occurred_at, published_at)
			VALUES ($1, 'order', 'o-1', 1, 'PaymentSucceeded', 1, 'payment.o-1.PaymentSucceeded', '{}',
			        now() - interval '1 minute', now() - interval '1 minute')`, id); err != nil {
			t.Fatal(err)
		}
		audits, err := verify.AuditStreams(ctx, verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{"payment": pay}}, audit,
			verify.AuditConfig{Window: time.Hour, Services: []string{"payment"}})
		if err != nil {
			t.Fatal(err)
		}
		if a := audits[0]; a.Err == nil || !strings.Contains(a.Err.Error(), "AllowDirect") {
			t.Fatalf("%+v, want an error naming AllowDirect", a)
		}
	})
}
