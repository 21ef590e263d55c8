package outbox

// Benchmarks that print figures (run with `make bench`). None of them asserts
// on time: the machine is shared and noisy. Each reports events/s (or tx/s,
// or milliseconds) as a custom metric so one run gives comparable numbers.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/shop-ref/shop/pkg/internal/testenv"
)

const (
	backlogEvents     = 50_000
	backlogAggregates = 10_000
	payloadSize       = 1024
)

// fillBacklog commits n pending 1 KiB events spread over aggregates, in
// bulk, with UUIDv7 ids as Writer gives them, so that claim order follows
// commit order as it does in production.
func fillBacklog(b *testing.B, e *env, n, aggregates int) {
	b.Helper()
	ctx := context.Background()
	payload := []byte(`{"blob":"` + strings.Repeat("x", payloadSize-11) + `"}`)
	rows := make([][]any, n)
	for i := range rows {
		agg := fmt.Sprint("o-", i%aggregates)
		rows[i] = []any{uuid.Must(uuid.NewV7()), "order", agg, int64(i/aggregates + 1), "Step", int32(1),
			"ev." + agg + ".Step", string(payload)}
	}
	_, err := e.db.Pool.CopyFrom(ctx, pgx.Identifier{"outbox"},
		[]string{"event_id", "aggregate_type", "aggregate_id", "aggregate_seq", "event_type", "schema_version", "subject", "payload"},
		pgx.CopyFromRows(rows))
	if err != nil {
		b.Fatal(err)
	}
	if _, err := e.db.Pool.Exec(ctx, `VACUUM ANALYZE outbox`); err != nil {
		b.Fatal(err)
	}
}

func benchEnv(b *testing.B) *env {
	b.Helper()
	e := &env{}
	e.db = newSchema(b)
	e.nats = testenv.NATS(b)
	_, e.js = e.nats.Connect(b)
	e.stream = e.nats.Stream(b, e.js, "EV", "ev.>")
	return e
}

// BenchmarkJetStreamPublish is the ceiling: raw async publishing of 1 KiB
// messages with a msg id, no database at all.
func BenchmarkJetStreamPublish(b *testing.B) {
	e := benchEnv(b)
	payload := []byte(strings.Repeat("x", payloadSize))
	const n = backlogEvents
	for range b.N {
		start := time.Now()
		testenv.PublishAll(b, e.js, n, func(i int) (*nats.Msg, string) {
			return &nats.Msg{Subject: fmt.Sprintf("ev.p-%d.Raw", i%1000), Data: payload}, uuid.NewString()
		})
		b.ReportMetric(float64(n)/time.Since(start).Seconds(), "events/s")
	}
}

// BenchmarkDatabaseOnly measures the relay's database work alone over a
// 50,000-event backlog, for the two designs the package could use: per-row
// claims (claim with a lease, then mark; what Relay does) and shard
// ownership (read the shard in order, then mark; no per-row claim write).
func BenchmarkDatabaseOnly(b *testing.B) {
	b.Run("design=row-claims", func(b *testing.B) {
		for range b.N {
			b.StopTimer()
			e := benchEnv(b)
			fillBacklog(b, e, backlogEvents, backlogAggregates)
			r := e.relayB(b, Config{})
			ctx := context.Background()
			b.StartTimer()
			start := time.Now()
			done := 0
			for done < backlogEvents {
				token := uuid.New()
				batch, err := r.claim(ctx, token)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := r.settle(ctx, token, batch, make([]result, len(batch))); err != nil {
					b.Fatal(err)
				}
				done += len(batch)
			}
			b.ReportMetric(float64(done)/time.Since(start).Seconds(), "events/s")
		}
	})
	b.Run("design=shard-owner", func(b *testing.B) {
		for range b.N {
			b.StopTimer()
			e := benchEnv(b)
			fillBacklog(b, e, backlogEvents, backlogAggregates)
			ctx := context.Background()
			b.StartTimer()
			start := time.Now()
			done := 0
			for done < backlogEvents {
				rows, err := e.db.Pool.Query(ctx, `SELECT event_id, subject, payload FROM outbox
					WHERE published_at IS NULL AND dead_at IS NULL ORDER BY event_id LIMIT 500`)
				if err != nil {
					b.Fatal(err)
				}
				var ids []uuid.UUID
				for rows.Next() {
					var id uuid.UUID
					var subj string
					var payload []byte
					if err := rows.Scan(&id, &subj, &payload); err != nil {
						b.Fatal(err)
					}
					ids = append(ids, id)
				}
				if _, err := e.db.Pool.Exec(ctx, `UPDATE outbox SET published_at = now() WHERE event_id = ANY($1)`, ids); err != nil {
					b.Fatal(err)
				}
				done += len(ids)
			}
			b.ReportMetric(float64(done)/time.Since(start).Seconds(), "events/s")
		}
	})
}

func (e *env) relayB(b *testing.B, cfg Config) *Relay {
	cfg.Logger = cmpLogger(nil)
	r, err := NewRelay(e.db.Pool, e.js, cfg)
	if err != nil {
		b.Fatal(err)
	}
	return r
}

// BenchmarkRelayDrain measures committed rows to marked-published over a
// 50,000-event backlog of 1 KiB events with 1 and 2 relays, each running one
// claim loop or two (the default).
func BenchmarkRelayDrain(b *testing.B) {
	for _, c := range []struct{ relays, workers int }{{1, 1}, {2, 1}, {1, 2}, {2, 2}} {
		relays := c.relays
		b.Run(fmt.Sprintf("relays=%d/workers=%d", c.relays, c.workers), func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				e := benchEnv(b)
				fillBacklog(b, e, backlogEvents, backlogAggregates)
				ctx, cancel := context.WithCancel(context.Background())
				var wg sync.WaitGroup
				rs := make([]*Relay, relays)
				for i := range rs {
					rs[i] = e.relayB(b, Config{Name: fmt.Sprint("r", i), PollInterval: 5 * time.Millisecond, Workers: c.workers})
				}
				b.StartTimer()
				start := time.Now()
				for _, r := range rs {
					wg.Go(func() { _ = r.Run(ctx) })
				}
				for {
					var pending int
					if err := e.db.Pool.QueryRow(context.Background(),
						`SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&pending); err != nil {
						b.Fatal(err)
					}
					if pending == 0 {
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
				elapsed := time.Since(start)
				b.StopTimer()
				cancel()
				wg.Wait()
				b.ReportMetric(float64(backlogEvents)/elapsed.Seconds(), "events/s")
				var dup int64
				for _, r := range rs {
					dup += r.Counters().Duplicates
				}
				b.ReportMetric(float64(dup), "duplicates")
			}
		})
	}
}

// BenchmarkCommitToBroker measures the latency from a business commit to
// the broker receiving its event (a core subscriber on the subject sees it
// as the stream stores it, just before the PubAck goes out) at a steady
// 500 events/s, with the relay woken by NOTIFY.
func BenchmarkCommitToBroker(b *testing.B) {
	for range b.N {
		b.StopTimer()
		e := benchEnv(b)
		nc, _ := e.nats.Connect(b)
		var mu sync.Mutex
		committed := map[string]time.Time{}
		var lat []time.Duration
		sub, err := nc.Subscribe("ev.>", func(m *nats.Msg) {
			at := time.Now()
			mu.Lock()
			defer mu.Unlock()
			if c, ok := committed[m.Header.Get("Nats-Msg-Id")]; ok {
				lat = append(lat, at.Sub(c))
			}
		})
		if err != nil {
			b.Fatal(err)
		}
		defer sub.Unsubscribe()
		ctx, cancel := context.WithCancel(context.Background())
		r := e.relayB(b, Config{})
		done := make(chan struct{})
		go func() { _ = r.Run(ctx); close(done) }()
		time.Sleep(200 * time.Millisecond) // LISTEN in place
		b.StartTimer()

		var w Writer
		const rate, seconds = 500, 5
		tick := time.NewTicker(time.Second / rate)
		for range rate * seconds {
			<-tick.C
			ev := event(uuid.NewString(), "Step")
			ev.ID = uuid.Must(uuid.NewV7())
			ev.Payload = map[string]string{"blob": strings.Repeat("x", payloadSize-20)}
			if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error { return w.Add(ctx, tx, ev) }); err != nil {
				b.Fatal(err)
			}
			mu.Lock()
			committed[ev.ID.String()] = time.Now()
			mu.Unlock()
		}
		tick.Stop()
		time.Sleep(500 * time.Millisecond)
		b.StopTimer()
		cancel()
		<-done
		mu.Lock()
		slices.Sort(lat)
		if len(lat) < rate*seconds*9/10 {
			b.Fatalf("saw %d of %d events", len(lat), rate*seconds)
		}
		q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) / 1000 }
		b.ReportMetric(q(0.50), "p50-ms")
		b.ReportMetric(q(0.99), "p99-ms")
		mu.Unlock()
	}
}

// BenchmarkWritePath compares a business transaction alone with the same
// transaction plus its 1 KiB outbox event: with no NOTIFY, a NOTIFY on
// every commit, NOTIFYs coalesced to one per 10 ms, and that with the
// sequence given by the caller instead of the counter row. Two business
// transactions: the smallest possible (one row), and one shaped like the
// shop's order creation (order, two lines, idempotency key). 8 writers.
func BenchmarkWritePath(b *testing.B) {
	shapes := []struct {
		name string
		sql  []string
	}{
		{"business=one-row", []string{`INSERT INTO business (id, customer, total) VALUES ($1, 'c-1', 1999)`}},
		{"business=order", []string{
			`INSERT INTO business (id, customer, total) VALUES ($1, 'c-1', 1999)`,
			`INSERT INTO business_lines (order_id, line, sku, quantity, unit_price) VALUES ($1, 1, 'SKU-1', 2, 999)`,
			`INSERT INTO business_lines (order_id, line, sku, quantity, unit_price) VALUES ($1, 2, 'SKU-2', 1, 1)`,
			`INSERT INTO business_keys (key, request_hash, order_id) VALUES ($1::uuid::text, 'sha256:…', $1)`,
		}},
	}
	writers := []struct {
		name      string
		writer    *Writer
		callerSeq bool // the new order's version (1) numbers its event
	}{
		{"outbox=none", nil, false},
		{"outbox=no-notify", &Writer{NotifyInterval: 24 * time.Hour}, false},
		{"outbox=notify-every-commit", &Writer{}, false},
		{"outbox=notify-coalesced-10ms", &Writer{NotifyInterval: 10 * time.Millisecond}, false},
		{"outbox=notify-coalesced-10ms+caller-seq", &Writer{NotifyInterval: 10 * time.Millisecond}, true},
	}
	for _, shape := range shapes {
		for _, v := range writers {
			b.Run(shape.name+"/"+v.name, func(b *testing.B) {
				for range b.N {
					b.StopTimer()
					e := benchEnv(b)
					ctx := context.Background()
					if _, err := e.db.Pool.Exec(ctx, `
						CREATE TABLE business (id uuid PRIMARY KEY, customer text NOT NULL, total bigint NOT NULL,
							created_at timestamptz NOT NULL DEFAULT now());
						CREATE TABLE business_lines (order_id uuid NOT NULL REFERENCES business, line int NOT NULL,
							sku text NOT NULL, quantity int NOT NULL, unit_price bigint NOT NULL, PRIMARY KEY (order_id, line));
						CREATE TABLE business_keys (key text PRIMARY KEY, request_hash text NOT NULL, order_id uuid NOT NULL,
							created_at timestamptz NOT NULL DEFAULT now())`); err != nil {
						b.Fatal(err)
					}
					if v.writer != nil {
						v.writer.lastNotify.Store(time.Now().UnixNano())
					}
					const writers, each = 8, 800
					var failed atomic.Int64
					b.StartTimer()
					start := time.Now()
					var wg sync.WaitGroup
					for range writers {
						wg.Go(func() {
							for range each {
								err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
									id := uuid.Must(uuid.NewV7())
									for _, q := range shape.sql {
										if _, err := tx.Exec(ctx, q, id); err != nil {
											return err
										}
									}
									if v.writer == nil {
										return nil
									}
									ev := event(id.String(), "OrderCreated")
									ev.Payload = map[string]string{"blob": strings.Repeat("x", payloadSize-20)}
									if v.callerSeq {
										ev.Seq = 1
									}
									return v.writer.Add(ctx, tx, ev)
								})
								if err != nil {
									if failed.Add(1) == 1 {
										b.Log(err)
									}
								}
							}
						})
					}
					wg.Wait()
					elapsed := time.Since(start)
					if failed.Load() > 0 {
						b.Fatalf("%d transactions failed", failed.Load())
					}
					b.ReportMetric(float64(writers*each)/elapsed.Seconds(), "tx/s")
				}
			})
		}
	}
}
