// Package loadgen drives orders through the public HTTP API of a local shop,
// as a careful client would, and reports throughput and latency: the
// command shop loadgen, callable as Run.
//
// Each order is a POST /orders with its own Idempotency-Key. A request that
// got no answer, a twin still in flight (409) or a shop refusing for now
// (429, 5xx) is sent again with the same key, after the answer's
// Retry-After or a capped backoff, so that a first attempt that did commit
// is answered with its order instead of making a second one. With -follow
// (the default) every order is polled until it settles and a fraction is
// paid through the payment service's fake provider the moment the order
// says WAIT_PAY; a refused payment fails the run, since the shop promises
// to take it. Only local targets are
// allowed: the URLs must name 127.0.0.1, localhost or ::1.
package loadgen

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"math"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// orderRun is what loadgen learns about one order.
type orderRun struct {
	id        string
	created   bool
	failed    error
	createdAt time.Time     // when the first POST of it was sent
	createLat time.Duration // first send to the 2xx
	toDone    time.Duration // first send to COMPLETED; 0 if never seen
	status    string        // the last status seen
}

// generator is one run of shop loadgen: its configuration, the HTTP client
// every request goes through, and the counters that the workers update and
// the progress line and the report read.
type generator struct {
	cfg    config
	out    io.Writer
	client *http.Client
	runID  string // in every Idempotency-Key: two runs never share a key

	created, failed, retried, completed, settled atomic.Int64
	payments, refused                            atomic.Int64 // payments taken, and refused, at WAIT_PAY
	firstErr                                     atomic.Value // string
}

// newGenerator returns a generator whose client keeps a connection for every
// creator and follower at once.
func newGenerator(cfg config, out io.Writer) *generator {
	// http.DefaultTransport may be wrapped (a test that checks every
	// response, running loadgen beside it): cloned when it is the standard
	// one, a plain transport otherwise.
	base, ok := http.DefaultTransport.(*http.Transport)
	if !ok {
		base = &http.Transport{}
	}
	tr := base.Clone()
	tr.MaxIdleConnsPerHost = 2*cfg.concurrency + 16
	var b [4]byte
	_, _ = rand.Read(b[:])
	return &generator{
		cfg: cfg, out: out, runID: hex.EncodeToString(b[:]),
		client: &http.Client{Transport: tr, Timeout: cfg.requestTimeout},
	}
}

// preflight fails fast when nothing listens at the order service, or at
// the payment service when orders are followed (and so paid). With
// -follow=false the payment service is never called, so the order service
// may run alone.
func (g *generator) preflight(ctx context.Context) error {
	bases := []string{g.cfg.orderURL}
	if g.cfg.follow {
		bases = append(bases, g.cfg.paymentURL)
	}
	for _, base := range bases {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/healthz", nil)
		if err != nil {
			return err
		}
		res, err := g.client.Do(req)
		if err != nil {
			return fmt.Errorf("loadgen: no shop service answers at %s: %w", base, err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			return fmt.Errorf("loadgen: %s/healthz answered %s", base, res.Status)
		}
	}
	return nil
}

// paid reports whether order i (from 0) is one of the paid ones; the paid
// orders are spread evenly and are exactly round(pay*N) of N.
func (g *generator) paid(i int) bool {
	return math.Floor(float64(i+1)*g.cfg.pay+1e-9) > math.Floor(float64(i)*g.cfg.pay+1e-9)
}

func (g *generator) noteErr(err error) {
	g.firstErr.CompareAndSwap(nil, err.Error())
}

func (g *generator) run(parent context.Context) error {
	ctx, cancel := context.WithTimeout(parent, g.cfg.timeout)
	defer cancel()
	n := g.cfg.orders
	runs := make([]orderRun, n)
	start := time.Now()

	// Feed the order numbers, at the rate asked for.
	jobs := make(chan int)
	go func() {
		defer close(jobs)
		var tick *time.Ticker
		if g.cfg.rate > 0 {
			tick = time.NewTicker(time.Duration(float64(time.Second) / g.cfg.rate))
			defer tick.Stop()
		}
		for i := range n {
			if tick != nil && i > 0 {
				select {
				case <-tick.C:
				case <-ctx.Done():
					return
				}
			}
			select {
			case jobs <- i:
			case <-ctx.Done():
				return
			}
		}
	}()

	// Followers poll orders in the background; their GETs share a limit so
	// that following does not drown the service.
	follow := make(chan struct{}, g.cfg.concurrency)
	var creators, followers sync.WaitGroup
	for range g.cfg.concurrency {
		creators.Go(func() {
			for i := range jobs {
				r := &runs[i]
				g.create(ctx, i, r)
				if !r.created {
					continue
				}
				if g.cfg.follow {
					followers.Go(func() { g.follow(ctx, i, r, follow) })
				}
			}
		})
	}

	stopProgress := g.progress(start, n)
	creators.Wait()
	creationEnd := time.Now()
	followers.Wait()
	stopProgress()

	timedOut := ctx.Err() != nil && parent.Err() == nil
	g.report(runs, start, creationEnd, time.Since(start), timedOut)
	switch {
	case parent.Err() != nil:
		return parent.Err()
	case timedOut:
		return fmt.Errorf("loadgen: stopped by -timeout %v before every order was done", g.cfg.timeout)
	case g.failed.Load() > 0:
		return fmt.Errorf("loadgen: %d of %d orders failed", g.failed.Load(), n)
	case g.refused.Load() > 0:
		return fmt.Errorf("loadgen: %d payments made the moment an order said WAIT_PAY were refused", g.refused.Load())
	}
	return nil
}
