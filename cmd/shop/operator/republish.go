package operator

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/cmd/shop/app"
	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/ops/verify"
	"github.com/shop-ref/shop/pkg/outbox"
)

// lostJSON is one event a stream lost, in the --json output of republish.
type lostJSON struct {
	Service       string    `json:"service"`
	Stream        string    `json:"stream"`
	EventID       uuid.UUID `json:"event_id"`
	EventType     string    `json:"event_type"`
	AggregateType string    `json:"aggregate_type"`
	AggregateID   string    `json:"aggregate_id"`
	AggregateSeq  int64     `json:"aggregate_seq"`
	PublishedAt   time.Time `json:"published_at"`
	Republished   bool      `json:"republished"`
}

// auditJSON is one service's stream audit in the --json output of
// republish.
type auditJSON struct {
	Service     string  `json:"service"`
	Stream      string  `json:"stream"`
	Published   int     `json:"published"` // events looked for
	Scanned     int     `json:"scanned"`   // stream messages read
	Lost        int     `json:"lost"`
	Republished int     `json:"republished"`
	Error       *string `json:"error"` // the stream could not be read: not audited
}

// republish is `shop outbox republish --lost [--service S] [--nats-url URL]`:
// it audits each stream against its outbox (ops/verify.AuditStreams)
// and marks the events the stream lost to be published again. A stream it
// could not read is reported and makes it fail after the others are
// repaired.
func (c *command) republish(ctx context.Context, args []string) error {
	fs := c.flags("")
	lost := fs.Bool("lost", false, "republish the events their stream lost (required: the only kind of republish there is; replay republishes chosen ones)")
	service := fs.String("service", "", "only this `service`'s outbox and stream (default: all)")
	natsURL := fs.String("nats-url", "", "NATS server `URL` (default: NATS_URL, else "+config.DefaultNATSURL+")")
	if _, err := c.parse(fs, args, 0, ""); err != nil {
		return err
	}
	if !*lost {
		return c.usageErr("--lost is required (to publish chosen events again, use replay)")
	}
	names, err := c.resolve(*service)
	if err != nil {
		return err
	}
	url := cmp.Or(*natsURL, app.OperatorNATSURL(c.natsURL))
	nc, err := nats.Connect(url, append(app.AuditConnectOptions(c.auditPassword), nats.Name("shop outbox republish"), nats.Timeout(5*time.Second))...)
	if err != nil {
		return fmt.Errorf("%s: cannot reach NATS at %s: %w", c.name, config.MaskURL(url), err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	for _, name := range names {
		if _, err := c.pool(ctx, name); err != nil {
			return err
		}
	}
	audits, err := verify.AuditStreams(ctx, verify.Shop{Services: c.schemas.Registry, Pools: c.pools}, js, verify.AuditConfig{Window: app.OutboxRetention, Services: names})
	if err != nil {
		return fmt.Errorf("%s: %w", c.name, err)
	}
	out := struct {
		Republished int         `json:"republished"`
		Lost        []lostJSON  `json:"lost"`
		Services    []auditJSON `json:"services"`
	}{Lost: []lostJSON{}}
	var unaudited []string
	for _, a := range audits {
		sum := auditJSON{Service: a.Service, Stream: a.Stream, Published: a.Published, Scanned: a.Scanned, Lost: len(a.Lost)}
		if a.Err != nil {
			msg := a.Err.Error()
			sum.Error = &msg
			unaudited = append(unaudited, fmt.Sprintf("%s (%s): %v", a.Service, a.Stream, a.Err))
		}
		var marked []uuid.UUID
		if len(a.Lost) > 0 {
			ids := make([]uuid.UUID, len(a.Lost))
			for i, l := range a.Lost {
				ids[i] = l.EventID
			}
			p, _ := c.pool(ctx, a.Service)
			if marked, err = outbox.RepublishAll(ctx, p, ids); err != nil {
				return fmt.Errorf("%s: %s: %w", c.name, a.Service, err)
			}
		}
		sum.Republished = len(marked)
		out.Republished += len(marked)
		for _, l := range a.Lost {
			out.Lost = append(out.Lost, lostJSON{Service: l.Service, Stream: l.Stream, EventID: l.EventID, EventType: l.Type,
				AggregateType: l.AggregateType, AggregateID: l.AggregateID, AggregateSeq: l.Seq, PublishedAt: l.PublishedAt,
				Republished: slices.Contains(marked, l.EventID)})
		}
		out.Services = append(out.Services, sum)
	}
	if c.json {
		if err := c.printJSON(out); err != nil {
			return err
		}
	} else {
		for _, a := range out.Services {
			if a.Error != nil {
				fmt.Fprintf(c.stdout, "%s: stream %s NOT AUDITED: %s\n", a.Service, a.Stream, *a.Error)
				continue
			}
			fmt.Fprintf(c.stdout, "%s: stream %s: %d published events looked for, %d messages read, %d lost, %d marked to be published again\n",
				a.Service, a.Stream, a.Published, a.Scanned, a.Lost, a.Republished)
			for _, l := range out.Lost {
				if l.Service != a.Service {
					continue
				}
				what := "republished"
				if !l.Republished {
					what = "skipped (no longer a published event: republished meanwhile, or deleted by retention)"
				}
				fmt.Fprintf(c.stdout, "  %s %s %s (%s %s, seq %d)\n", what, l.EventType, l.EventID, l.AggregateType, l.AggregateID, l.AggregateSeq)
			}
		}
		if len(out.Services) > 1 {
			fmt.Fprintf(c.stdout, "total: %d lost event(s) marked to be published again\n", out.Republished)
		}
	}
	if len(unaudited) > 0 {
		// What could be read was repaired; what could not is no success.
		return fmt.Errorf("%s: not audited: %s", c.name, strings.Join(unaudited, "; "))
	}
	return nil
}
