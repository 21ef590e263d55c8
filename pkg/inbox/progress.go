package inbox

import (
	"context"
	"sync"
	"time"
)

// progress keeps JetStream from redelivering what this process still holds.
// AckWait is short so that a dead process's deliveries come back quickly;
// a live one's deliveries (waiting in a worker's queue, or in a handler that
// takes long) are therefore reported in progress every AckWait/3, which
// restarts JetStream's AckWait for them.
type progress struct {
	mu   sync.Mutex
	held map[*delivery]time.Time // when JetStream last heard of each
}

func newProgress() *progress { return &progress{held: map[*delivery]time.Time{}} }

// hold registers a delivery from the moment it is fetched.
func (p *progress) hold(d *delivery) {
	p.mu.Lock()
	p.held[d] = time.Now()
	p.mu.Unlock()
}

// release forgets a delivery once it is settled (or abandoned, as a crash
// abandons it: then JetStream redelivers it after AckWait).
func (p *progress) release(d *delivery) {
	p.mu.Lock()
	delete(p.held, d)
	p.mu.Unlock()
}

// run reports the held deliveries that JetStream has not heard of for
// every, until ctx ends. Most deliveries settle within milliseconds and
// are never reported.
func (p *progress) run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			p.mu.Lock()
			var due []*delivery
			for d, last := range p.held {
				if now.Sub(last) >= every {
					due = append(due, d)
					p.held[d] = now
				}
			}
			p.mu.Unlock()
			for _, d := range due {
				// Fire and forget: a lost report costs at worst one
				// redelivery, which the inbox absorbs.
				_ = d.msg.InProgress()
			}
		}
	}
}
