package loyalty

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/inbox"
	"github.com/shop-ref/shop/pkg/outbox"
)

// guide: constructor
// Config is the loyalty service's own settings.
type Config struct{ CentsPerPoint int64 }

// Service is the loyalty service.
type Service struct {
	pool      *pgxpool.Pool
	cfg       Config
	log       *slog.Logger
	outbox    outbox.Writer
	consumers []*inbox.Consumer
}

func New(d registry.Deps, cfg Config) (*Service, error) {
	if cfg.CentsPerPoint <= 0 {
		return nil, fmt.Errorf("loyalty: LOYALTY_CENTS_PER_POINT must be at least 1, not %d", cfg.CentsPerPoint)
	}
	// The writer makes each event's subject, <prefix>.<aggregate id>.<type>.
	s := &Service{pool: d.Pool, cfg: cfg, log: d.Log(), outbox: outbox.Writer{Prefix: prefix}}
	// d.Inbox gives each consumer the shop's windows, logger, tracer and
	// hooks; the declaration gives it its name, stream and types.
	for _, c := range []registry.Consumer{ordersConsumer, paymentConsumer} {
		cfg := d.Inbox(c, inbox.Each(s.handle))
		// Workers is the service's lever on its Postgres connections: each
		// worker holds one while it applies a batch, and the pool needs
		// Workers+2 per consumer (PoolSize). A side service's one worker
		// keeps up with the shop's rate on two cores.
		cfg.Workers = 1
		consumer, err := inbox.NewConsumer(d.Pool, d.JetStream, cfg)
		if err != nil {
			return nil, fmt.Errorf("loyalty: %w", err)
		}
		s.consumers = append(s.consumers, consumer)
	}
	return s, nil
}

func (s *Service) Routes(r chi.Router)          { r.Get("/points/{customer}", s.getPoints) }
func (s *Service) Consumers() []*inbox.Consumer { return s.consumers }

// Run runs the consumers until ctx ends; each waits for its stream and
// JetStream by itself.
func (s *Service) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, c := range s.consumers {
		g.Go(func() error { return c.Run(ctx) })
	}
	return g.Wait()
}

// guide: end constructor
