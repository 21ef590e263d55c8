package order

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/registry"
)

// admission sheds new orders while the saga cannot keep up. Every order
// starts a chain of 15 deliveries across the four services (counted in
// docs/architecture.md, "Backpressure"); accepting
// orders faster than that chain is worked off only grows a backlog, and the
// CPU spent taking the surplus is taken from the orders already in flight,
// so fewer of them complete, not more. While the saga's streams hold more
// than a limit of events their consumers have not yet settled, POST /orders
// answers 503 with Retry-After and writes nothing: the client retries with
// the same Idempotency-Key. A retry whose key has a stored response is not
// new work and still gets that response (createOrder).
//
// The backlog is read from JetStream (the saga's own consumers, those the
// registry marks Saga: messages not yet delivered plus those delivered and not yet
// acked) every interval, so a request never waits for it. Events still in a
// producer's outbox are not counted: a relay that is behind shows in its
// shop_outbox_backlog_events metric instead. A consumer outside the saga (a
// loyalty service reading ORDERS, say) is not counted either: its lag says
// nothing about how fast orders complete, and it must not throttle them. A
// consumer takes part in admission by Saga: true in its service's entry
// (registry.Consumer).
type admission struct {
	js    jetstream.JetStream
	limit int64 // shed above this many events; <= 0: never shed
	every time.Duration
	log   *slog.Logger
	// consumers are those whose backlog counts: the saga's (sagaConsumers).
	consumers []durable
	backlog   atomic.Int64 // the last reading
}

// durable names a durable consumer on a stream.
type durable struct{ stream, consumer string }

// sagaConsumers are the shop's consumers that carry an order through its
// saga: the consumers whose backlog admission counts.
func sagaConsumers(readers []registry.Reader) []durable {
	var saga []durable
	for _, r := range readers {
		if r.Saga {
			saga = append(saga, durable{stream: r.Stream, consumer: r.Name})
		}
	}
	return saga
}

// run reads the backlog until ctx ends. A failed reading keeps the last
// one: a broker outage is no reason to refuse orders (the outbox holds
// their events until it is back).
func (a *admission) run(ctx context.Context) {
	if a.limit <= 0 {
		return
	}
	tick := time.NewTicker(a.every)
	defer tick.Stop()
	for {
		n, err := a.read(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			a.log.Debug("saga backlog not read; keeping the last reading", "err", err)
		case err == nil:
			if old := a.backlog.Swap(n); (old > a.limit) != (n > a.limit) {
				a.log.Warn("order admission changed", "shedding", n > a.limit, "backlog", n, "limit", a.limit)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// read sums the unsettled messages of the saga's consumers.
func (a *admission) read(ctx context.Context) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, a.every)
	defer cancel()
	var total int64
	for _, sc := range a.consumers {
		cons, err := a.js.Consumer(ctx, sc.stream, sc.consumer)
		if errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrConsumerNotFound) {
			continue // not started yet: nothing waits there
		}
		if err != nil {
			return 0, fmt.Errorf("consumer %s on %s: %w", sc.consumer, sc.stream, err)
		}
		info := cons.CachedInfo()
		total += int64(info.NumPending) + int64(max(info.NumAckPending, 0))
	}
	return total, nil
}

// overloaded is the answer to a POST /orders that is shed.
type overloaded struct{ backlog, limit int64 }

func (e overloaded) Error() string {
	return fmt.Sprintf("the shop is busy: %d events wait for their consumers (limit %d)", e.backlog, e.limit)
}

// shed reports whether to refuse a new order now: the last reading is above
// the limit.
func (a *admission) shed() (overloaded, bool) {
	n := a.backlog.Load()
	return overloaded{backlog: n, limit: a.limit}, a.limit > 0 && n > a.limit
}

// writeOverloaded answers 503 with Retry-After: the request wrote nothing and
// may be sent again, with the same Idempotency-Key, a second later (the
// backlog is read five times in that second).
func writeOverloaded(w http.ResponseWriter, r *http.Request, log *slog.Logger, e overloaded) {
	httpx.WriteProblem(w, r, log, httpx.NewProblem(http.StatusServiceUnavailable, "overloaded",
		e.Error()+": wait Retry-After seconds for the consumers to work them off, then send the same request again with the same Idempotency-Key").WithRetryAfter(time.Second))
}
