//go:build shopbench

package benchsuite

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/internal/broker"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/natstest"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services"
	"github.com/shop-ref/shop/services/order"
)

// Row 9: what durability costs. The relay drain of row 2 (one relay) and
// the whole saga of row 6 against a NATS server that fsyncs every two
// minutes (nats-server's default, the tests' servers) and one that fsyncs
// before every acknowledgement (sync always: `shop all`'s embedded server
// and the compose files), their runs interleaved so that the machine's
// drift does not land on one side of the ratio. For both saga variants the
// server runs in the benchmark process and `shop all` connects to it
// (NATS_URL), so the two differ in the fsync alone; row 6 runs the shop's
// own embedded server, which syncs always. Then the stream audit of `shop
// verify` (verify.AuditStreams) over a stream of sz.backlog events.
func durability(b *testing.B, t *table, sz sizes) {
	lazy, always := broker.WithSyncInterval(broker.ServerDefaultSyncInterval), broker.WithSyncAlways()
	const lazyLabel, alwaysLabel = "NATS fsync every 2 min", "NATS sync always"

	var drain [2]measuredRuns
	for range *runs {
		for i, opt := range []broker.Option{lazy, always} {
			m := relayDrain(b, sz, 1, opt)
			drain[i].rates, drain[i].busy = append(drain[i].rates, m.rate), append(drain[i].busy, m.busy)
		}
	}
	var sagas [2][]sagaResult
	for range *runs {
		for i, opt := range []broker.Option{lazy, always} {
			r := saga(b, sz, opt)
			// A ratio against a saga that completed nothing in its window
			// says nothing about the fsync: the run failed. A quick run's
			// window (4 s) can end before a sync-always saga completes its
			// first order, on a busy machine; it fails only when no order
			// completed at all, after the window too.
			if r.completed == 0 || (!*quick && r.rate == 0) {
				b.Fatalf("row 9: the saga against the %s server completed %d orders (%.1f/s in its window)",
					[]string{lazyLabel, alwaysLabel}[i], r.completed, r.rate)
			}
			sagas[i] = append(sagas[i], r)
		}
	}
	secs := *sagaSeconds
	if *quick {
		secs = 4 // as saga() runs it
	}
	for i, label := range []string{lazyLabel, alwaysLabel} {
		t.add("9", fmt.Sprintf("relay drain 50k, 1 relay × 2 workers, %s", label), "events/s", drain[i].rates)
		t.add("9", fmt.Sprintf("  machine CPU busy meanwhile (%s)", label), "%", drain[i].busy)
	}
	for i, label := range []string{lazyLabel, alwaysLabel} {
		var rate, p99, cpu, busy []float64
		for _, r := range sagas[i] {
			rate, p99, cpu, busy = append(rate, r.rate), append(p99, r.p99), append(cpu, r.cpuPerOrder), append(busy, r.busy)
		}
		t.add("9", fmt.Sprintf("whole saga, %d s at %g orders/s offered, %s: COMPLETED/s", secs, *sagaRate, label), "orders/s", rate)
		t.add("9", fmt.Sprintf("  order → COMPLETED p99 (%s)", label), "ms", p99)
		t.add("9", fmt.Sprintf("  machine CPU busy in the measured window (%s)", label), "%", busy)
		t.add("9", fmt.Sprintf("  machine CPU per completed order (%s)", label), "ms", cpu)
	}
	t.add("9", fmt.Sprintf("stream audit (shop verify), %s published events, one stream", fmtNum(float64(sz.backlog))), "events/s", auditStream(b, sz))

	t.ratio(fmt.Sprintf("relay drain 50k, 1 relay × 2 workers, %s", alwaysLabel), fmt.Sprintf("relay drain 50k, 1 relay × 2 workers, %s", lazyLabel), "of fsync every 2 min", "")
	t.ratio(fmt.Sprintf("whole saga, %d s at %g orders/s offered, %s: COMPLETED/s", secs, *sagaRate, alwaysLabel),
		fmt.Sprintf("whole saga, %d s at %g orders/s offered, %s: COMPLETED/s", secs, *sagaRate, lazyLabel), "of fsync every 2 min", "")
	t.ratio(fmt.Sprintf("  machine CPU per completed order (%s)", alwaysLabel), fmt.Sprintf("  machine CPU per completed order (%s)", lazyLabel), "of fsync every 2 min", "")
	t.ratio(fmt.Sprintf("  order → COMPLETED p99 (%s)", alwaysLabel), fmt.Sprintf("  order → COMPLETED p99 (%s)", lazyLabel), "of fsync every 2 min", "")
}

// auditStream measures verify.AuditStreams over the order service's outbox
// with sz.backlog published events (COPY) and the ORDERS stream holding
// their messages (1 KiB, the contract's headers, nine events per order),
// the last one deleted so that the scan reads the whole stream: the read of
// the outbox rows, one pass over the stream (direct gets in batches), the
// comparison. One schema and stream; every run audits them again.
func auditStream(b *testing.B, sz sizes) []float64 {
	return scoped(b, func(tb testing.TB) []float64 {
		ctx := context.Background()
		order := pgtest.New(tb, order.Registration.Sets()...).Pool
		srv := natstest.New(tb)
		_, js := srv.Connect(tb)
		st := srv.Stream(tb, js, "ORDERS", "orders.>")
		n := sz.backlog
		ids := make([]uuid.UUID, n)
		for i := range ids {
			ids[i] = uuid.Must(uuid.NewV7())
		}
		agg := func(i int) string { return "o-" + strconv.Itoa(i/9) }
		payload := []byte(`{"blob":"` + blob + `"}`)
		natstest.PublishAll(tb, js, n, func(i int) (*nats.Msg, string) {
			h := nats.Header{}
			h.Set("Event-Type", "Step")
			h.Set("Aggregate-Type", "order")
			h.Set("Aggregate-Id", agg(i))
			h.Set("Aggregate-Seq", strconv.Itoa(i%9+1))
			h.Set("Schema-Version", "1")
			return &nats.Msg{Subject: "orders." + agg(i) + ".Step", Header: h, Data: payload}, ids[i].String()
		})
		at := time.Now().Add(-time.Minute)
		i := 0
		src := pgx.CopyFromFunc(func() ([]any, error) {
			if i == n {
				return nil, nil
			}
			row := []any{ids[i], "order", agg(i), int64(i%9 + 1), "Step", int32(1), "orders." + agg(i) + ".Step", `{}`, at, at}
			i++
			return row, nil
		})
		if _, err := order.CopyFrom(ctx, pgx.Identifier{"outbox"}, []string{"event_id", "aggregate_type", "aggregate_id",
			"aggregate_seq", "event_type", "schema_version", "subject", "payload", "occurred_at", "published_at"}, src); err != nil {
			tb.Fatal(err)
		}
		if _, err := order.Exec(ctx, `VACUUM ANALYZE outbox`); err != nil {
			tb.Fatal(err)
		}
		info, err := st.Info(ctx)
		if err != nil {
			tb.Fatal(err)
		}
		if err := st.DeleteMsg(ctx, info.State.LastSeq); err != nil {
			tb.Fatal(err)
		}
		var out []float64
		for range *runs {
			start := time.Now()
			audits, err := verify.AuditStreams(ctx, verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{"order": order}}, js, verify.AuditConfig{Window: time.Hour, Services: []string{"order"}})
			el := time.Since(start)
			if err != nil {
				tb.Fatal(err)
			}
			if a := audits[0]; a.Err != nil || len(a.Lost) != 1 || a.Scanned != n-1 {
				tb.Fatalf("stream audit: %+v, want the one deleted message lost and the rest read", a)
			}
			out = append(out, float64(n)/el.Seconds())
		}
		return out
	})
}
