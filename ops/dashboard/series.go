package dashboard

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Consumer is one of the shop's inbox consumers, as the lag chart needs to
// know it.
type Consumer struct {
	// Name is its consumer_name in the inbox tables ("inventory-orders").
	Name string
	// Service is the service that runs it; its processed_events are in
	// that service's schema.
	Service string
	// Source is the service whose outbox publishes what it reads.
	Source string
	// Types are the event types it is delivered; nil: all of the source's.
	Types []string
}

// The charts' windows.
const (
	// lagWindow bounds the events the lag counts: those committed this long
	// ago at most, so that each sample reads a minute of rows by index, not
	// the outbox's whole retention. With a minute at 90 orders/s (43,000
	// events in the order outbox and as many in a consumer's
	// processed_events) a sample's query took 16 ms on the order schema and
	// 8 ms on inventory's (Postgres 15, this repository's test machine).
	lagWindow = time.Minute
	// latencyWindow is how far back the latency percentiles look: one
	// second of completions is too few for a p99 in a demo.
	latencyWindow = 30 * time.Second
	// historyMargin is how far below the highest order_history id seen a
	// sample looks again: ids are taken in insertion order but committed in
	// another, so a COMPLETED row can appear below one already read.
	historyMargin = 1000
)

// Sample is the shop at one instant, as the charts plot it.
type Sample struct {
	At time.Time
	// Completed is the orders that reached COMPLETED per second since the
	// sample before.
	Completed float64
	// P50 and P99 are the order → COMPLETED latency percentiles, in
	// milliseconds, of the orders completed in the last latencyWindow; NaN
	// when none did.
	P50, P99 float64
	// Backlog is each service's outbox rows not yet published (nor dead);
	// Lag each consuming service's lag (see lag). Missing: not read.
	Backlog, Lag map[string]float64
}

// sampler keeps the samples in a ring of Config.Window and what it needs to
// take the next one. Only Run's goroutine uses it but for the ring, which
// it writes, and handlers copy, under Server.seriesMu.
type sampler struct {
	ring []Sample
	next int // where the next sample goes
	full bool

	floor       int64            // order_history ids at or below this predate the dashboard
	seen        map[int64]bool   // COMPLETED history ids already counted, above floor
	completions []completion     // the last latencyWindow's
	lastAt      time.Time        // the previous sample's time
	failing     map[string]error // per schema, so a lasting failure is logged once
	read        map[string]bool  // the schemas read at least once
}

type completion struct {
	at      time.Time
	latency float64 // milliseconds
}

// Run samples the charts every Config.SampleInterval and the health strip
// every Config.HealthInterval until ctx ends. Without it the page still
// shows the live state, with empty charts and no health strip.
func (s *Server) Run(ctx context.Context) error {
	sample := time.NewTicker(s.cfg.SampleInterval)
	defer sample.Stop()
	health := time.NewTicker(s.cfg.HealthInterval)
	defer health.Stop()
	healthDone := make(chan []Health, 1)
	askHealth := func() {
		go func() { healthDone <- s.checkHealth(ctx) }()
	}
	askHealth()
	asking := true
	s.takeSample(ctx)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-sample.C:
			s.takeSample(ctx)
		case h := <-healthDone:
			s.seriesMu.Lock()
			s.health = h
			s.seriesMu.Unlock()
			asking = false
		case <-health.C:
			// A check still in flight (a hung service) is not doubled.
			if !asking {
				askHealth()
				asking = true
			}
		}
	}
}

// takeSample reads one sample, at most one query per schema, and puts it
// in the ring.
func (s *Server) takeSample(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.SampleInterval)
	defer cancel()
	sm := &s.sampler
	now := time.Now()
	smp := Sample{At: now, P50: math.NaN(), P99: math.NaN(), Backlog: map[string]float64{}, Lag: map[string]float64{}}
	since := uuidAt(now.Add(-lagWindow))
	published := map[string]map[string]float64{} // source -> event type -> published in the window
	processed := map[string]float64{}            // consumer -> processed in the window
	var fresh []completion
	for _, name := range s.services {
		rows, err := s.readSample(ctx, name, since)
		if err != nil {
			// Logged once per outage, and only for a schema read before:
			// while `shop all` starts, the services have not migrated yet.
			if sm.failing[name] == nil && sm.read[name] && ctx.Err() == nil {
				s.cfg.Logger.Warn("dashboard sample not read", "service", name, "err", err)
			}
			sm.failing[name] = err
			continue
		}
		delete(sm.failing, name)
		sm.read[name] = true
		published[name] = map[string]float64{}
		for _, r := range rows {
			switch r.kind {
			case "pending":
				smp.Backlog[name] = r.n
			case "published":
				published[name][r.key] = r.n
			case "processed":
				processed[r.key] = r.n
			case "floor":
				if sm.seen == nil { // the first sample: what is already COMPLETED is history
					sm.floor, sm.seen = int64(r.n), map[int64]bool{}
				}
			case "completed":
				id, _ := strconv.ParseInt(r.key, 10, 64)
				if id > sm.floor && !sm.seen[id] {
					sm.seen[id] = true
					fresh = append(fresh, completion{at: now, latency: r.n * 1000})
				}
			}
		}
	}
	// Forget ids no later sample reads again.
	below := sm.highSeen() - historyMargin
	for id := range sm.seen {
		if id <= below {
			delete(sm.seen, id)
		}
	}
	if !sm.lastAt.IsZero() {
		smp.Completed = float64(len(fresh)) / now.Sub(sm.lastAt).Seconds()
	}
	sm.lastAt = now
	sm.completions = append(sm.completions, fresh...)
	sm.completions = slices.DeleteFunc(sm.completions, func(c completion) bool { return now.Sub(c.at) > latencyWindow })
	if len(sm.completions) > 0 {
		ls := make([]float64, len(sm.completions))
		for i, c := range sm.completions {
			ls[i] = c.latency
		}
		slices.Sort(ls)
		smp.P50, smp.P99 = percentile(ls, 0.50), percentile(ls, 0.99)
	}
	for _, c := range s.cfg.Consumers {
		pub, sourceRead := published[c.Source]
		_, consumerRead := published[c.Service]
		if !sourceRead || !consumerRead {
			continue // a schema was not read: no point rather than a wrong one
		}
		done := processed[c.Name]
		var want float64
		for typ, n := range pub {
			if c.Types == nil || slices.Contains(c.Types, typ) {
				want += n
			}
		}
		// A consumer may record an event before the relay marks it
		// published (the broker's ack and the relay's commit race): that
		// is no lag, and never a negative one.
		smp.Lag[c.Service] += max(want-done, 0)
	}
	s.seriesMu.Lock()
	sm.ring[sm.next] = smp
	sm.next = (sm.next + 1) % len(sm.ring)
	sm.full = sm.full || sm.next == 0
	s.seriesMu.Unlock()
}

func (sm *sampler) highSeen() int64 {
	high := sm.floor
	for id := range sm.seen {
		high = max(high, id)
	}
	return high
}

type sampleRow struct {
	kind, key string
	n         float64
}

// readSample is the one query of a sample on schema name: its outbox
// backlog, what its outbox published in the lag window by event type, what
// its consumers processed in that window, and for the order schema the
// orders completed since the last sample with their latency.
func (s *Server) readSample(ctx context.Context, name string, since uuid.UUID) ([]sampleRow, error) {
	var consumers []string
	for _, c := range s.cfg.Consumers {
		if c.Service == name {
			consumers = append(consumers, c.Name)
		}
	}
	// outbox_pending is a partial index of exactly the pending rows; the
	// window's rows are read through the primary keys, as event ids are
	// UUIDv7 and so ordered by the time they were made.
	q := []string{
		`SELECT 'pending'::text, ''::text, count(*)::float8 FROM outbox WHERE published_at IS NULL AND dead_at IS NULL`,
		`SELECT 'published', event_type, count(*)::float8 FROM outbox WHERE event_id >= $1 AND published_at IS NOT NULL GROUP BY event_type`,
		`SELECT 'processed', consumer_name, count(*)::float8 FROM processed_events
			WHERE consumer_name = ANY($2) AND event_id >= $1 GROUP BY consumer_name`,
	}
	args := []any{since, consumers}
	if name == "order" {
		from := s.sampler.highSeen() - historyMargin
		if s.sampler.seen == nil {
			from = math.MaxInt64 // only the floor: what completed before the dashboard started is not a rate
		}
		q = append(q,
			`SELECT 'floor', '', coalesce(max(id), 0)::float8 FROM order_history`,
			`SELECT 'completed', h.id::text, extract(epoch FROM h.at - o.created_at)::float8
				FROM order_history h JOIN orders o USING (order_id) WHERE h.id > $3 AND h.status = 'COMPLETED'`)
		args = append(args, from)
	}
	rows, err := s.cfg.Pools[name].Query(ctx, strings.Join(q, "\nUNION ALL\n"), args...)
	if err != nil {
		return nil, fmt.Errorf("sample %s: %w", name, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (sampleRow, error) {
		var sr sampleRow
		err := r.Scan(&sr.kind, &sr.key, &sr.n)
		return sr, err
	})
	if err != nil {
		return nil, fmt.Errorf("sample %s: %w", name, err)
	}
	return out, nil
}

// uuidAt is the least UUIDv7 of instant t: every event id made at t or
// later sorts at or above it.
func uuidAt(t time.Time) uuid.UUID {
	var u uuid.UUID
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(t.UnixMilli()))
	copy(u[:6], ms[2:])
	u[6] = 0x70 // version 7
	u[8] = 0x80 // RFC 4122 variant
	return u
}

// percentile is the p-th of sorted, by nearest rank.
func percentile(sorted []float64, p float64) float64 {
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[max(i, 0)]
}

// Series is the ring as GET /api/series answers it: columns of equal
// length, oldest first, as the page's charts (uPlot) take them. A null is a
// value not read.
type Series struct {
	WindowSeconds  float64 `json:"window_seconds"`
	IntervalSecond float64 `json:"interval_seconds"`
	// LagWindowSeconds bounds the events the lag counts (see Lag).
	LagWindowSeconds float64 `json:"lag_window_seconds"`
	// T holds the samples' times in Unix seconds.
	T         []float64  `json:"t"`
	Completed []*float64 `json:"completed_per_second"`
	P50       []*float64 `json:"latency_p50_ms"`
	P99       []*float64 `json:"latency_p99_ms"`
	// Backlog is each service's outbox rows waiting for the relay.
	Backlog map[string][]*float64 `json:"backlog"`
	// Lag is, per consuming service, the events its consumers' sources
	// published in the last LagWindowSeconds (of the types each consumer is
	// delivered) that are not yet in its processed_events.
	Lag map[string][]*float64 `json:"lag"`
}

// series copies the ring into columns.
func (s *Server) series() Series {
	s.seriesMu.Lock()
	defer s.seriesMu.Unlock()
	sm := &s.sampler
	var samples []Sample
	if sm.full {
		samples = append(samples, sm.ring[sm.next:]...)
	}
	samples = append(samples, sm.ring[:sm.next]...)
	out := Series{
		WindowSeconds: s.cfg.Window.Seconds(), IntervalSecond: s.cfg.SampleInterval.Seconds(),
		LagWindowSeconds: lagWindow.Seconds(),
		T:                make([]float64, 0, len(samples)), Completed: []*float64{}, P50: []*float64{}, P99: []*float64{},
		Backlog: map[string][]*float64{}, Lag: map[string][]*float64{},
	}
	num := func(f float64) *float64 {
		if math.IsNaN(f) {
			return nil
		}
		return &f
	}
	for _, name := range s.services {
		out.Backlog[name] = make([]*float64, 0, len(samples))
	}
	for _, c := range s.cfg.Consumers {
		out.Lag[c.Service] = make([]*float64, 0, len(samples))
	}
	for _, smp := range samples {
		out.T = append(out.T, float64(smp.At.UnixMilli())/1000)
		out.Completed = append(out.Completed, num(smp.Completed))
		out.P50 = append(out.P50, num(smp.P50))
		out.P99 = append(out.P99, num(smp.P99))
		for name := range out.Backlog {
			out.Backlog[name] = append(out.Backlog[name], value(smp.Backlog, name))
		}
		for name := range out.Lag {
			out.Lag[name] = append(out.Lag[name], value(smp.Lag, name))
		}
	}
	return out
}

// value is m[name] for the JSON, null when the sample has none.
func value(m map[string]float64, name string) *float64 {
	v, ok := m[name]
	if !ok {
		return nil
	}
	return &v
}
