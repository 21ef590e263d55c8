// Package metrics is what each service serves on /metrics: its own
// Prometheus registry, the instruments its parts feed while they run, and
// what is read when Prometheus scrapes.
package metrics

import (
	"context"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shop-ref/shop/internal/probe"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// Service is one service's Prometheus registry and the instruments that the
// service's parts feed while they run. Everything else is read when
// Prometheus scrapes: the outbox backlog from Postgres, the consumers' lag
// from JetStream, the libraries' running totals from memory.
//
// The libraries know nothing of Prometheus: pkg/outbox, pkg/inbox and
// pkg/saga keep plain counters and call optional observer funcs, and this
// package adapts them. Each service has a registry of its own, so that `shop
// all` serves four separate /metrics, like four processes would.
type Service struct {
	reg *prometheus.Registry
	r   prometheus.Registerer // reg, adding the service label to every metric
	log *slog.Logger

	publish  prometheus.Histogram     // outbox claim → broker ack, per event
	process  *prometheus.HistogramVec // inbox processing time, by consumer
	requests *prometheus.CounterVec   // HTTP requests by method, route, code
	failures *prometheus.CounterVec   // HTTP 5xx answers by method, route
	duration *prometheus.HistogramVec // HTTP latency by method, route
}

// New returns the metrics of the service called service.
func New(service string, log *slog.Logger) *Service {
	reg := prometheus.NewRegistry()
	m := &Service{
		reg: reg,
		r:   prometheus.WrapRegistererWith(prometheus.Labels{"service": service}, reg),
		log: log,
		publish: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "shop_outbox_publish_latency_seconds",
			Help:    "Time from the commit of an event's claim to the relay reading the broker's ack, per event.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 15), // 0.5ms … 8s
		}),
		process: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "shop_consumer_processing_seconds",
			Help:    "Time from a worker taking a delivery to the commit of its inbox transaction (applied or duplicate).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 15),
		}, []string{"consumer"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shop_http_requests_total",
			Help: "HTTP requests answered, by method, route pattern and status code.",
		}, []string{"method", "route", "code"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shop_http_request_errors_total",
			Help: "HTTP requests answered with a 5xx status, by method and route pattern.",
		}, []string{"method", "route"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "shop_http_request_duration_seconds",
			Help:    "Time to answer an HTTP request, by method and route pattern.",
			Buckets: prometheus.DefBuckets,
		}, []string{"method", "route"}),
	}
	m.r.MustRegister(m.publish, m.process, m.requests, m.failures, m.duration)
	// The runtime's own metrics, without the service label: under `shop
	// all` the four services share one process.
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// ObservePublish is the relay's outbox.Hooks.ObservePublishFunc.
func (m *Service) ObservePublish(d time.Duration) { m.publish.Observe(d.Seconds()) }

// ObserveProcess is the consumers' inbox.Hooks.ObserveFunc.
func (m *Service) ObserveProcess(consumer string, d time.Duration) {
	m.process.WithLabelValues(consumer).Observe(d.Seconds())
}

// Handler serves the registry in the Prometheus text format. A part that
// cannot be read (the database or NATS is down) is left out and logged;
// the rest is still served, because an outage is when metrics matter most.
func (m *Service) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		ErrorLog:      slog.NewLogLogger(m.log.Handler(), slog.LevelWarn),
		ErrorHandling: promhttp.ContinueOnError,
	})
}

// Instrument is the router middleware that counts and times requests by
// chi route pattern ("/orders/{id}"), read after the handler ran, when
// routing has filled it in. Paths no route matched share one label value,
// so that scanners probing random URLs cannot grow the series without end.
func (m *Service) Instrument(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		ww := middleware.NewWrapResponseWriter(w, r.ProtoMajor)
		next.ServeHTTP(ww, r)

		route := "unmatched"
		if rc := chi.RouteContext(r.Context()); rc != nil && rc.RoutePattern() != "" {
			route = rc.RoutePattern()
		}
		method := r.Method
		switch method {
		case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
			http.MethodPatch, http.MethodDelete, http.MethodOptions:
		default:
			method = "OTHER" // the method is the client's choice too
		}
		code := ww.Status()
		if code == 0 {
			code = http.StatusOK // the handler wrote nothing
		}
		m.requests.WithLabelValues(method, route, strconv.Itoa(code)).Inc()
		if code >= 500 {
			m.failures.WithLabelValues(method, route).Inc()
		}
		m.duration.WithLabelValues(method, route).Observe(time.Since(start).Seconds())
	})
}

// InitRoutes creates the error and latency series of every route r serves,
// so that a route's error count reads 0 instead of being absent until its
// first failure (absent series make rate() and alerts blind).
func (m *Service) InitRoutes(r chi.Routes) {
	_ = chi.Walk(r, func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		m.failures.WithLabelValues(method, route)
		m.duration.WithLabelValues(method, route)
		return nil
	})
}

// MustRegister adds collectors of the service's other parts (the
// reconciler's, the stream keeper's) to its registry, with the service
// label.
func (m *Service) MustRegister(cs ...prometheus.Collector) { m.r.MustRegister(cs...) }

// scrapeTimeout bounds the queries one scrape makes.
const scrapeTimeout = 5 * time.Second

// Watch registers what is read at scrape time: the outbox of db and the
// totals of relay, the counters and lag of the domain's consumers and, when
// the domain runs sagas, their instances per state and the timeouts fired.
func (m *Service) Watch(db outbox.DB, relay *outbox.Relay, dom registry.Domain, nc *nats.Conn, js *probe.JetStream) {
	c := &scrapeCollector{db: db, relay: relay, nc: nc, js: js, started: time.Now(), seenStates: map[string]bool{}}
	c.consumers = dom.Consumers()
	for _, cons := range c.consumers {
		m.process.WithLabelValues(cons.Name()) // a series from the start, empty until the first event
	}
	if d, ok := dom.(interface{ TimeoutsFired() int64 }); ok {
		c.timeoutsFired = d.TimeoutsFired
	}
	m.r.MustRegister(c)
}

// The metrics of scrapeCollector.
var (
	descBacklog = prometheus.NewDesc("shop_outbox_backlog_events",
		"Outbox events committed and not yet published (dead ones excluded).", nil, nil)
	descOldest = prometheus.NewDesc("shop_outbox_oldest_pending_age_seconds",
		"Age of the oldest event in the backlog; 0 when it is empty.", nil, nil)
	descDead = prometheus.NewDesc("shop_outbox_dead_events",
		"Outbox events given up on, waiting for an operator.", nil, nil)
	descPublished = prometheus.NewDesc("shop_outbox_published_events_total",
		"Events this process's relay published and marked.", nil, nil)
	descPublishFailures = prometheus.NewDesc("shop_outbox_publish_failures_total",
		"Failed publish attempts of this process's relay (retried or made dead).", nil, nil)
	descMadeDead = prometheus.NewDesc("shop_outbox_events_made_dead_total",
		"Events this process's relay made dead.", nil, nil)
	descExpiredLeases = prometheus.NewDesc("shop_outbox_expired_leases_total",
		"Events this process's relay claimed over an earlier claim's expired lease (that relay died or stalled).", nil, nil)
	descLostLeases = prometheus.NewDesc("shop_outbox_lost_leases_total",
		"Events this process's relay published but could not mark, its lease having passed to another relay.", nil, nil)

	descProcessed = prometheus.NewDesc("shop_consumer_processed_total",
		"Events a consumer applied and committed.", []string{"consumer"}, nil)
	descDuplicates = prometheus.NewDesc("shop_consumer_duplicates_total",
		"Copies of events a consumer absorbed without effect.", []string{"consumer"}, nil)
	descRetries = prometheus.NewDesc("shop_consumer_retries_total",
		"Failed deliveries a consumer handed back for another attempt.", []string{"consumer"}, nil)
	descDeadLetters = prometheus.NewDesc("shop_consumer_dead_letters_total",
		"Events a consumer dead-lettered.", []string{"consumer"}, nil)
	descStale = prometheus.NewDesc("shop_consumer_stale_total",
		"New event ids at a passed sequence whose record is gone (older than the inbox retention), skipped.", []string{"consumer"}, nil)
	descConflicts = prometheus.NewDesc("shop_consumer_conflicts_total",
		"Events at a sequence where another event was applied, dead-lettered as conflicts (alert on any).", []string{"consumer"}, nil)
	descParkedTotal = prometheus.NewDesc("shop_consumer_parked_total",
		"Early events this process parked until the gap before them was filled.", []string{"consumer"}, nil)
	descParked = prometheus.NewDesc("shop_consumer_parked_events",
		"Events parked now (all instances), waiting for an earlier event of their aggregate.", []string{"consumer"}, nil)
	descParkedAge = prometheus.NewDesc("shop_consumer_oldest_parked_age_seconds",
		"Age of the oldest parked event; 0 when none. One that grows is stranded: its predecessor is missing or dead.", []string{"consumer"}, nil)
	descLag = prometheus.NewDesc("shop_consumer_lag_messages",
		"Messages of the stream the durable consumer has not settled yet (JetStream NumPending + NumAckPending).", []string{"consumer"}, nil)

	descNATSConnected = prometheus.NewDesc("shop_nats_connected",
		"1 while the process's NATS connection is CONNECTED, else 0.", nil, nil)
	descJetStreamUp = prometheus.NewDesc("shop_jetstream_up",
		"1 while JetStream answers this process (probed every 2s), else 0; the connection may be up while JetStream is not.", nil, nil)
	descRelayUnavailable = prometheus.NewDesc("shop_outbox_broker_unavailable",
		"1 while the relay finds that the broker takes nothing and pauses (no attempts counted), else 0.", nil, nil)
	descRelayOutages = prometheus.NewDesc("shop_outbox_broker_outages_total",
		"Times this process's relay found that the broker took nothing and paused.", nil, nil)
	descDeferred = prometheus.NewDesc("shop_outbox_deferred_events_total",
		"Events this process's relay handed back without counting an attempt, because the broker took nothing.", nil, nil)
	descSincePublish = prometheus.NewDesc("shop_outbox_seconds_since_last_publish",
		"Seconds since the broker last acked an event of this process's relay (since the process started, before the first).", nil, nil)
	descRelayStreaming = prometheus.NewDesc("shop_outbox_relay_streaming",
		"1 while this process's relay streams the outbox's replication slot (cdc mode), else 0: it polls, another copy streams, or the database cannot serve CDC.", nil, nil)
	descCDCUnavailable = prometheus.NewDesc("shop_outbox_cdc_unavailable",
		"1 while the relay is in cdc mode but the database cannot serve it (wal_level, slots, senders, the REPLICATION privilege: the log says which) and the relay polls instead, else 0.", nil, nil)
	descHandedOff = prometheus.NewDesc("shop_outbox_handed_off_events_total",
		"Events this process's relay's stream left to the outbox table's poller (their aggregate's previous event not yet published, or a failure of their own).", nil, nil)
	descSlotLag = prometheus.NewDesc("shop_outbox_slot_lag_bytes",
		"How far the service's replication slot's confirmed position (confirmed_flush_lsn) is behind the server's current one: what its relay has yet to settle.", nil, nil)
	descSlotWALHeld = prometheus.NewDesc("shop_outbox_slot_wal_held_bytes",
		"WAL the server keeps for the service's replication slot: from its restart_lsn to the current position. More than the lag while a transaction stays open anywhere on the server (shop_postgres_oldest_transaction_age_seconds).", nil, nil)
	descOldestXact = prometheus.NewDesc("shop_postgres_oldest_transaction_age_seconds",
		"Age of the oldest transaction open on the service's Postgres server that holds a transaction id (prepared ones too); 0 when none. It holds back every logical slot's restart_lsn, so the WAL they keep. Other roles' transactions are seen only with pg_read_all_stats.", nil, nil)
	descSlotLagAge = prometheus.NewDesc("shop_outbox_slot_lag_age_seconds",
		"Seconds since the streaming relay last had everything it was sent confirmed to the slot; 0 when no relay streamed since the slot was made.", nil, nil)
	descSlotSafeWAL = prometheus.NewDesc("shop_outbox_slot_safe_wal_size_bytes",
		"WAL that may still be written before the slot is in danger of being invalidated by max_slot_wal_keep_size; -1: no limit (the disk is the limit).", nil, nil)
	descSlotWALStatus = prometheus.NewDesc("shop_outbox_slot_wal_status",
		"1 for the slot's pg_replication_slots.wal_status (reserved, extended, unreserved, lost), 0 for the others.", []string{"status"}, nil)

	descSubscribed = prometheus.NewDesc("shop_consumer_subscribed",
		"1 while the consumer pulls from JetStream, 0 while it subscribes again (JetStream away, consumer or stream lost).", []string{"consumer"}, nil)
	descResubscribes = prometheus.NewDesc("shop_consumer_resubscribes_total",
		"Subscriptions of the consumer that JetStream ended or lost, each followed by a new one.", []string{"consumer"}, nil)
	descSinceDelivery = prometheus.NewDesc("shop_consumer_seconds_since_last_delivery",
		"Seconds since JetStream last delivered a message to the consumer (since the process started, before the first).", []string{"consumer"}, nil)

	descSagas = prometheus.NewDesc("shop_saga_instances",
		"Saga instances by current state (the order saga's join states STOCK_HELD and PAYMENT_OPEN are orders that show PENDING).", []string{"state"}, nil)
	descTimeouts = prometheus.NewDesc("shop_saga_timeouts_fired_total",
		"Saga timeouts this process's scanner fired.", nil, nil)
)

// scrapeCollector reads its metrics when Prometheus scrapes. The libraries'
// totals count from this process's start, as counters should.
type scrapeCollector struct {
	db            outbox.DB
	relay         *outbox.Relay
	nc            *nats.Conn
	js            *probe.JetStream
	started       time.Time
	consumers     []*inbox.Consumer
	timeoutsFired func() int64 // nil: the domain runs no sagas

	mu         sync.Mutex
	seenStates map[string]bool // saga states reported before: they read 0 once empty, rather than vanish
}

// Describe implements prometheus.Collector.
func (c *scrapeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descBacklog, descOldest, descDead, descPublished, descPublishFailures,
		descMadeDead, descExpiredLeases, descLostLeases, descNATSConnected, descJetStreamUp, descRelayUnavailable,
		descRelayOutages, descDeferred, descSincePublish, descRelayStreaming, descCDCUnavailable, descHandedOff,
		descSlotLag, descSlotWALHeld, descOldestXact, descSlotLagAge, descSlotSafeWAL, descSlotWALStatus} {
		ch <- d
	}
	if len(c.consumers) > 0 {
		for _, d := range []*prometheus.Desc{descProcessed, descDuplicates, descRetries, descDeadLetters, descLag,
			descSubscribed, descResubscribes, descSinceDelivery, descStale, descConflicts, descParkedTotal, descParked, descParkedAge} {
			ch <- d
		}
	}
	if c.timeoutsFired != nil {
		ch <- descSagas
		ch <- descTimeouts
	}
}

// WALStatuses are the values of pg_replication_slots.wal_status, each a
// series of shop_outbox_slot_wal_status.
var WALStatuses = []string{"reserved", "extended", "unreserved", "lost"}

// collectSlot reports the service's replication slot when the relay is in
// cdc mode or the slot exists (a service switched back to poll whose slot
// still pins WAL must show it): the WAL a forgotten slot holds fills the
// server's disk unseen otherwise.
func (c *scrapeCollector) collectSlot(ctx context.Context, ch chan<- prometheus.Metric, rs outbox.State) {
	ss, err := outbox.ReadSlot(ctx, c.db, rs.Slot)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(descSlotLag, err)
		return
	}
	if !ss.Exists && rs.Mode != outbox.ModeCDC {
		return
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	gauge(descSlotLag, float64(ss.LagBytes))
	gauge(descSlotWALHeld, float64(ss.RestartLagBytes))
	gauge(descOldestXact, ss.OldestXactAge.Seconds())
	gauge(descSlotLagAge, ss.LagAge.Seconds())
	gauge(descSlotSafeWAL, float64(ss.SafeWALSize))
	for _, st := range WALStatuses {
		gauge(descSlotWALStatus, oneIf(ss.Exists && ss.WALStatus == st), st)
	}
}

// Collect implements prometheus.Collector. A failed read becomes an invalid
// metric, which the handler logs and leaves out.
func (c *scrapeCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()

	if st, err := outbox.ReadStats(ctx, c.db); err != nil {
		ch <- prometheus.NewInvalidMetric(descBacklog, err)
	} else {
		ch <- prometheus.MustNewConstMetric(descBacklog, prometheus.GaugeValue, float64(st.Pending))
		ch <- prometheus.MustNewConstMetric(descOldest, prometheus.GaugeValue, st.OldestPending.Seconds())
		ch <- prometheus.MustNewConstMetric(descDead, prometheus.GaugeValue, float64(st.Dead))
	}
	rc := c.relay.Counters()
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	counter(descPublished, rc.Published)
	counter(descPublishFailures, rc.Retried+rc.Dead)
	counter(descMadeDead, rc.Dead)
	counter(descExpiredLeases, rc.TakenOver)
	counter(descLostLeases, rc.LostLeases)
	counter(descRelayOutages, rc.Outages)
	counter(descDeferred, rc.Deferred)
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	gauge(descNATSConnected, oneIf(c.nc.Status() == nats.CONNECTED))
	gauge(descJetStreamUp, oneIf(c.js.Up()))
	rs := c.relay.State()
	gauge(descRelayUnavailable, oneIf(!rs.UnavailableSince.IsZero()))
	gauge(descSincePublish, time.Since(latest(rs.LastPublish, c.started)).Seconds())
	gauge(descRelayStreaming, oneIf(rs.Streaming))
	gauge(descCDCUnavailable, oneIf(rs.CDCUnavailable != ""))
	counter(descHandedOff, rs.HandedOff)
	c.collectSlot(ctx, ch, rs)

	for _, cons := range c.consumers {
		name := cons.Name()
		cc := cons.Counters()
		counter(descProcessed, cc.Processed, name)
		counter(descDuplicates, cc.Duplicates, name)
		counter(descRetries, cc.Retries, name)
		counter(descDeadLetters, cc.DeadLetters, name)
		counter(descResubscribes, cc.Resubscribes, name)
		counter(descStale, cc.Stale, name)
		counter(descConflicts, cc.Conflicts, name)
		counter(descParkedTotal, cc.Parked, name)
		if n, oldest, err := inbox.ParkedStats(ctx, c.db, name); err != nil {
			ch <- prometheus.NewInvalidMetric(descParked, err)
		} else {
			age := 0.0
			if !oldest.IsZero() {
				age = time.Since(oldest).Seconds()
			}
			gauge(descParked, float64(n), name)
			gauge(descParkedAge, age, name)
		}
		st := cons.State()
		gauge(descSubscribed, oneIf(st.Subscribed), name)
		gauge(descSinceDelivery, time.Since(latest(st.LastDelivery, c.started)).Seconds(), name)
		if lag, err := cons.Lag(ctx); err != nil {
			ch <- prometheus.NewInvalidMetric(descLag, err)
		} else {
			ch <- prometheus.MustNewConstMetric(descLag, prometheus.GaugeValue, float64(lag), name)
		}
	}

	if c.timeoutsFired != nil {
		counter(descTimeouts, c.timeoutsFired())
		c.collectSagas(ctx, ch)
	}
}

func oneIf(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// latest is t, or since when t is zero (nothing happened yet).
func latest(t, since time.Time) time.Time {
	if t.IsZero() {
		return since
	}
	return t
}

func (c *scrapeCollector) collectSagas(ctx context.Context, ch chan<- prometheus.Metric) {
	rows, err := c.db.Query(ctx, `SELECT state, count(*) FROM saga_instances GROUP BY state`)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(descSagas, err)
		return
	}
	counts := map[string]int64{}
	var (
		state string
		n     int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&state, &n}, func() error { counts[state] = n; return nil }); err != nil {
		ch <- prometheus.NewInvalidMetric(descSagas, err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for s := range counts {
		c.seenStates[s] = true
	}
	for s := range c.seenStates {
		ch <- prometheus.MustNewConstMetric(descSagas, prometheus.GaugeValue, float64(counts[s]), s)
	}
}
