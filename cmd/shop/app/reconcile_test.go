package app

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shop-ref/shop/ops/reconcile"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/proof/pgtest"
	"github.com/shop-ref/shop/services"
)

// The reconcile collector serves the last run's findings by kind.
func TestReconcileCollector(t *testing.T) {
	t.Parallel()
	shop := verify.Shop{Services: services.All, Pools: map[string]*pgxpool.Pool{}}
	for _, e := range services.All {
		shop.Pools[e.Name] = pgtest.New(t, e.Sets()...).Pool
	}
	ctx := context.Background()
	// An order PENDING for an hour: stuck.
	_, err := shop.Pools["order"].Exec(ctx, `INSERT INTO orders (order_id, customer_id, status, total, created_at, updated_at)
		VALUES ($1, 'c', 'PENDING', 1, now() - interval '1 hour', now() - interval '1 hour')`, uuid.New())
	if err != nil {
		t.Fatal(err)
	}
	job := &reconcile.Job{Shop: shop}
	reg := prometheus.NewRegistry()
	reg.MustRegister(newReconcileCollector(job))
	gather := func() map[string]float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]float64{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				key := mf.GetName()
				for _, l := range m.GetLabel() {
					key += "/" + l.GetValue()
				}
				got[key] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
			}
		}
		return got
	}
	if got := gather(); got["shop_reconcile_runs_total"] != 0 || got["shop_reconcile_findings/stuck_order"] != 0 {
		t.Fatalf("before a run: %v", got)
	}
	if _, err := job.Once(ctx); err != nil {
		t.Fatal(err)
	}
	got := gather()
	want := map[string]float64{
		"shop_reconcile_runs_total": 1, "shop_reconcile_findings/stuck_order": 1,
		"shop_reconcile_findings/unrefunded_payment": 0, "shop_reconcile_findings/held_reservation": 0,
		"shop_reconcile_republished_events": 0,
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
}
