package app

import (
	"cmp"
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/ops/reconcile"
)

// The reconciler compares every service's schema (orders, payments and
// reservations side by side). Each of its queries runs on the owning
// service's pool, with that service's database URL (and role, when each
// service has its own), and a republish or requeue writes only the
// producer's own outbox. Repair must not wait for a person, so it runs
// wherever the saga does: in every process that runs the order service
// (`shop all`, or `shop order` and its copies), one at a time across them
// (an advisory lock in the order service's database, leader.go), and on
// demand in `shop verify -repair`. It needs every service's database URL;
// a process given only its own (a least-privilege deployment) logs each
// run that fails, and the schemas it cannot read are the operator's to
// grant.

// newReconcileJob returns the periodic reconcile job of cfg's databases
// and, with nc (the audit user's connection), of the streams (each stream
// audited against its outbox, what it lost republished); without nc the
// job checks and repairs the databases only. Its pools connect lazily, so
// runs simply fail (and are logged) until the services have migrated their
// schemas. Copies run it one at a time (the lock in leader.go). close
// releases the pools and the lock.
func newReconcileJob(ctx context.Context, cfg config.Config, nc *nats.Conn, log *slog.Logger) (job *reconcile.Job, close func(), err error) {
	shop, closeShop, err := OpenShop(ctx, cfg.Schemas(), ShopPoolSize)
	if err != nil {
		return nil, nil, fmt.Errorf("reconcile: %w", err)
	}
	rcfg := ReconcileConfig(cfg.Settings)
	if nc != nil {
		js, err := jetstream.New(nc)
		if err != nil {
			closeShop()
			return nil, nil, fmt.Errorf("reconcile: %w", err)
		}
		rcfg.JetStream = js
	}
	log = log.With("service", "reconcile")
	lock := &leader{url: cfg.DatabaseURLOf("order"), key: reconcileLockKey(cfg), log: log}
	return &reconcile.Job{
			Shop:     shop,
			Config:   rcfg,
			Interval: cmp.Or(cfg.ReconcileInterval, config.ReconcileInterval),
			Logger:   log,
			Leader:   lock.hold,
		}, func() {
			lock.release()
			closeShop()
		}, nil
}

// reconcileLockKey is the advisory lock the reconciler's copies share: one
// per shop, named by the order service's database and schema, so that two
// shops in one database (tests, say) do not stand each other by.
func reconcileLockKey(cfg config.Config) int64 {
	h := fnv.New64a()
	schema := ""
	if e, err := cfg.Registry.Get("order"); err == nil {
		schema = e.Schema
	}
	h.Write([]byte("shop reconcile\x00" + cfg.DatabaseURLOf("order") + "\x00" + schema))
	return int64(h.Sum64())
}

// reconcileGrace is the reconciler's slack past the saga's own deadlines.
const reconcileGrace = 5 * time.Minute

// ReconcileConfig is the reconciler's configuration for a shop whose
// services' settings are settings, repairs on: an order is stuck only once the saga's own
// deadline for its state (ORDER_RESERVATION_TIMEOUT for PENDING,
// PAYMENT_TIMEOUT for WAIT_PAY, ORDER_FULFILLMENT_TIMEOUT for PAID and
// FULFILLING) is past by the grace, since until then the
// saga's timeouts are the ones to end it.
func ReconcileConfig(settings *registry.Env) reconcile.Config {
	return reconcile.Config{
		// The order service's settings; zero (the reconciler's defaults)
		// for a shop without them.
		Pending:        config.Setting[time.Duration](settings, "ORDER_RESERVATION_TIMEOUT") + reconcileGrace,
		PaymentTimeout: config.Setting[time.Duration](settings, "PAYMENT_TIMEOUT"),
		Paid:           config.Setting[time.Duration](settings, "ORDER_FULFILLMENT_TIMEOUT") + reconcileGrace,
		Grace:          reconcileGrace,
		Repair:         true,
		Retention:      OutboxRetention, // the window of the stream audit, when JetStream is set
	}
}

// reconcileCollector exposes the last run of job: what it found, by kind,
// and how many lost events it republished. The order service's registry
// carries it, as the saga's owner.
type reconcileCollector struct {
	job                                       *reconcile.Job
	found, republished, requeued, run, leader *prometheus.Desc
}

func newReconcileCollector(job *reconcile.Job) *reconcileCollector {
	return &reconcileCollector{
		job: job,
		found: prometheus.NewDesc("shop_reconcile_findings",
			"What the last reconcile run found that retries did not fix, by kind: stuck_order, unrefunded_payment, held_reservation, lost_event.",
			[]string{"kind"}, nil),
		republished: prometheus.NewDesc("shop_reconcile_republished_events",
			"Lost events the last reconcile run republished from their producer's outbox.", nil, nil),
		requeued: prometheus.NewDesc("shop_reconcile_requeued_events",
			"Dead events the last reconcile run put back into their outbox: they had died of a missing stream.", nil, nil),
		run: prometheus.NewDesc("shop_reconcile_runs_total", "Completed reconcile runs.", nil, nil),
		leader: prometheus.NewDesc("shop_reconcile_leader",
			"1 while this process is the copy that runs the reconciler (copies take turns by an advisory lock), 0 while it stands by.", nil, nil),
	}
}

func (c *reconcileCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.found
	ch <- c.republished
	ch <- c.requeued
	ch <- c.run
	ch <- c.leader
}

func (c *reconcileCollector) Collect(ch chan<- prometheus.Metric) {
	counts, runs := c.job.Last()
	for _, k := range reconcile.Kinds {
		ch <- prometheus.MustNewConstMetric(c.found, prometheus.GaugeValue, float64(counts.Of(k)), string(k))
	}
	ch <- prometheus.MustNewConstMetric(c.republished, prometheus.GaugeValue, float64(counts.Republished))
	ch <- prometheus.MustNewConstMetric(c.requeued, prometheus.GaugeValue, float64(counts.Requeued))
	ch <- prometheus.MustNewConstMetric(c.run, prometheus.CounterValue, float64(runs))
	leading := 0.0
	if c.job.Leading() {
		leading = 1
	}
	ch <- prometheus.MustNewConstMetric(c.leader, prometheus.GaugeValue, leading)
}
