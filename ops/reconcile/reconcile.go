package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shop-ref/shop/ops/verify"
)

// Run finds stuck orders, unrefunded payments and held reservations once,
// with cfg.JetStream the events the streams lost, and, with cfg.Repair,
// republishes the events about them that were lost.
//
// Its rules are the order saga's, so it reads the order, inventory and
// payment services' schemas by those names (an error when shop lacks one);
// the events it republishes follow every consumer of the shop (flows).
func Run(ctx context.Context, shop verify.Shop, cfg Config) (Report, error) {
	cfg.setDefaults()
	if cfg.JetStream != nil && cfg.Retention <= 0 {
		return Report{}, errors.New("reconcile: Config.JetStream without Config.Retention (the outbox retention)")
	}
	r := &run{ctx: ctx, shop: shop, cfg: cfg, repaired: map[string]int{}}
	for name, p := range map[string]**pgxpool.Pool{"order": &r.order, "inventory": &r.inventory, "payment": &r.payment} {
		pool, err := shop.Pool(name)
		if err != nil {
			return Report{}, fmt.Errorf("reconcile: %w", err)
		}
		*p = pool
	}
	if err := r.stuckOrders(); err != nil {
		return Report{}, err
	}
	if err := r.unrefundedPayments(); err != nil {
		return Report{}, err
	}
	if err := r.rejectedPayments(); err != nil {
		return Report{}, err
	}
	if err := r.heldReservations(); err != nil {
		return Report{}, err
	}
	if cfg.JetStream != nil {
		if err := r.lostEvents(); err != nil {
			return Report{}, err
		}
	}
	if cfg.Repair {
		// What an outage killed goes back to its outbox first, so that
		// the relays publish it and its aggregates move on.
		if err := r.requeueOutageDeaths(); err != nil {
			return r.report(), err
		}
		// The streams' losses next: the per-order repair below then skips
		// the events they republished (no longer marked published).
		if err := r.repairLost(); err != nil {
			return r.report(), err
		}
		if err := r.repair(); err != nil {
			return r.report(), err
		}
	}
	return r.report(), nil
}

type run struct {
	ctx  context.Context
	shop verify.Shop
	// The pools of the saga's services, whose rules the checks are.
	order, inventory, payment *pgxpool.Pool
	cfg                       Config
	findings                  []Finding
	audits                    []verify.StreamAudit
	repaired                  map[string]int // order id → events republished
	total                     int
	requeued                  []Requeued // dead events put back (requeue.go)
}

func (r *run) report() Report {
	rep := Report{Findings: r.findings, Audits: r.audits, Requeued: r.requeued}
	for i := range rep.Findings {
		f := &rep.Findings[i]
		switch f.Kind {
		case StuckOrder:
			rep.Counts.StuckOrders++
		case UnrefundedPayment:
			rep.Counts.UnrefundedPayments++
		case HeldReservation:
			rep.Counts.HeldReservations++
		case LostEvent:
			rep.Counts.LostEvents++
		}
	}
	// One order may be found by several kinds; its repair is told once. A
	// lost event's finding tells its own.
	told := map[string]bool{}
	for i := range rep.Findings {
		f := &rep.Findings[i]
		if f.Kind == LostEvent {
			continue
		}
		if n := r.repaired[f.OrderID]; n > 0 && !told[f.OrderID] {
			f.Republished = n
			told[f.OrderID] = true
		}
	}
	rep.Counts.Republished = r.total
	rep.Counts.Requeued = len(r.requeued)
	return rep
}

func micros(d time.Duration) int64 { return d.Microseconds() }

func wrap(what string, err error) error {
	if err != nil {
		return fmt.Errorf("reconcile: %s: %w", what, err)
	}
	return nil
}
