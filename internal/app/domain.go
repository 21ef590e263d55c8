package app

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/services/fulfillment"
	"github.com/shop-ref/shop/services/inventory"
	"github.com/shop-ref/shop/services/order"
	"github.com/shop-ref/shop/services/payment"
)

// domain is a service's business part: its HTTP routes, its background
// work (consumers, timers), which returns when ctx ends, and its consumers,
// whose metrics, windows and stream limits the service watches and checks.
// Part of the interface, so that a service without Consumers does not
// compile, where a type assertion would drop its metrics without a word.
type domain interface {
	Routes(r chi.Router)
	Run(ctx context.Context) error
	Consumers() []*inbox.Consumer
}

// newDomain builds the business part of the service called name;
// observe (may be nil) receives its consumers' processing times. Its
// failpoints go to internal/failpoint, armed by cmd/shop from
// SHOP_FAILPOINTS and inert otherwise. The order domain also has
// TimeoutsFired() int64, which the metrics read (see metrics.watch).
func newDomain(name string, pool *pgxpool.Pool, js jetstream.JetStream, cfg Config, log *slog.Logger,
	observe func(consumer string, d time.Duration), tp trace.TracerProvider) (domain, error) {
	// Copies of an event can come this long after its first publish from
	// the relays this binary runs; every inbox must remember ids longer.
	horizon := relayConfig().RetryHorizon()
	switch name {
	case "order":
		maxBacklog := cfg.OrderMaxBacklog
		if maxBacklog == 0 {
			maxBacklog = -1 // the variable's 0 means never; order.Config's 0 means its default
		}
		return order.New(pool, js, order.Config{PaymentTimeout: cfg.PaymentTimeout, ReservationTimeout: cfg.ReservationTimeout,
			KeyTTL: cfg.IdempotencyKeyTTL, MaxBacklog: maxBacklog,
			PublishHorizon: horizon, Logger: log, ObserveInboxFunc: observe, FailpointFunc: failpoint.Inject, TracerProvider: tp})
	case "inventory":
		if cfg.OperatorToken == "" {
			log.Warn("OPERATOR_TOKEN is not set: PUT /stock/{sku}, an operator's restock, is open to anyone who reaches the inventory service; set one outside the demo")
		}
		return inventory.New(pool, js, inventory.Config{Logger: log, OperatorToken: cfg.OperatorToken, PublishHorizon: horizon,
			ObserveInboxFunc: observe, FailpointFunc: failpoint.Inject, TracerProvider: tp})
	case "payment":
		if cfg.WebhookSecret == DefaultWebhookSecret {
			log.Warn("PAYMENT_WEBHOOK_SECRET is the public demo default: anyone can forge payment callbacks; set your own outside the demo")
		}
		if cfg.FakeProvider {
			log.Warn("PAYMENT_FAKE_PROVIDER is on: POST /payments/{id}/simulate lets any client have the fake provider pay any order; demo only")
		}
		return payment.New(pool, js, payment.Config{WebhookSecret: cfg.WebhookSecret, Simulate: cfg.FakeProvider, Logger: log,
			PublishHorizon: horizon, ObserveInboxFunc: observe, FailpointFunc: failpoint.Inject, TracerProvider: tp})
	case "fulfillment":
		return fulfillment.New(pool, js, fulfillment.Config{Delay: cfg.FulfillmentDelay, Logger: log, PublishHorizon: horizon, ObserveInboxFunc: observe,
			FailpointFunc: failpoint.Inject, TracerProvider: tp})
	}
	return nil, fmt.Errorf("unknown service %q", name)
}

// poolSize is how many connections a service's pool may open: each inbox
// consumer needs its workers plus two, the relay its workers plus one.
func poolSize(name string) int32 {
	if name == "order" {
		return order.PoolSize + 4 // three consumers, and the relay
	}
	return 14 // one consumer of 8 workers, the relay and the HTTP handlers
}
