package chaos

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// consumersOf are service's durable consumers and the producer whose outbox
// feeds each.
func (h *harness) consumersOf(service string) []struct{ name, producer string } {
	var out []struct{ name, producer string }
	for _, r := range h.cfg.Services.Readers() {
		if r.Service == service {
			producer, _ := h.cfg.Services.Owner(r.Stream)
			out = append(out, struct{ name, producer string }{r.Name, producer.Name})
		}
	}
	return out
}

// redeliveryWindow: the events whose delivery a SIGKILL may have cut short
// are those published in this long before it.
const redeliveryWindow = 2 * time.Second

// Redelivery is what one SIGKILL of a shop process cost its consumers.
type Redelivery struct {
	Slot   string
	At     time.Time
	D      time.Duration // the largest publish→processed delay (see harness.redelivery)
	During string        // the broker fault active at the kill that concerns its service, if any
}

// redelivery measures, for each SIGKILL of a shop process, the largest
// publish→processed delay (the consumer's processed_events.processed_at —
// its inbox transaction's start — minus the producer outbox's
// published_at, the relay's mark after the PubAck, joined by event id)
// among the events of the killed service's consumers published in the
// redeliveryWindow before the kill: an event the killed process had
// fetched and not acked waits for its redelivery, the others show the
// ordinary delay. Kills with no such event give no figure. A kill is
// during a broker fault when one was active (from redeliveryWindow before
// its start until its heal) and concerned the killed service: every fault
// but a partition or reset of another service's process.
func (h *harness) redelivery(ctx context.Context) ([]Redelivery, error) {
	h.mu.Lock()
	kills := slices.Clone(h.kills)
	faults := h.faultsCopy()
	h.mu.Unlock()
	var out []Redelivery
	for _, k := range kills {
		var worst *time.Duration
		for _, c := range h.consumersOf(k.service) {
			var secs *float64
			err := h.admin.QueryRow(ctx, `
				SELECT max(extract(epoch FROM p.processed_at - o.published_at))::float8
				FROM `+h.schema(k.service)+`.processed_events p
				JOIN `+h.schema(c.producer)+`.outbox o ON o.event_id = p.event_id
				WHERE p.consumer_name = $1 AND o.published_at BETWEEN $2::timestamptz - $3::interval AND $2`,
				c.name, k.at, redeliveryWindow.String()).Scan(&secs)
			if err != nil {
				return nil, fmt.Errorf("redelivery after killing %s: %w", k.slot, err)
			}
			if secs != nil {
				d := time.Duration(*secs * float64(time.Second))
				if worst == nil || d > *worst {
					worst = &d
				}
			}
		}
		if worst == nil {
			continue
		}
		r := Redelivery{Slot: k.slot, At: k.at, D: *worst}
		for _, f := range faults {
			local := laneOf(f.Kind) != "broker"
			if local && serviceOf(f.Target) != k.service {
				continue
			}
			if k.at.After(f.Start.Add(-redeliveryWindow)) && !k.at.After(f.Heal) {
				r.During = f.Kind + " " + f.Target
				break
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// serviceOf is the service of a slot's name (order-1: order).
func serviceOf(slot string) string {
	if i := strings.LastIndexByte(slot, '-'); i > 0 {
		return slot[:i]
	}
	return slot
}

// writeRedelivery prints p50 and max over every kill and over those
// outside broker faults, and the three worst.
func (h *harness) writeRedelivery(out io.Writer, rs []Redelivery) {
	fmt.Fprintf(out, "redelivery after a process kill (largest publish→processed delay of its consumers' events published %v before it): ",
		redeliveryWindow)
	if len(rs) == 0 {
		fmt.Fprintln(out, "no kill had events in flight")
		return
	}
	var all, clean []time.Duration
	for _, r := range rs {
		all = append(all, r.D)
		if r.During == "" {
			clean = append(clean, r.D)
		}
	}
	fmt.Fprintf(out, "p50 %s, max %s over %d kills; outside broker faults p50 %s, max %s over %d\n",
		secs(percentile(all, 50)), secs(percentile(all, 100)), len(all),
		secs(percentile(clean, 50)), secs(percentile(clean, 100)), len(clean))
	worst := slices.Clone(rs)
	slices.SortFunc(worst, func(a, b Redelivery) int { return cmp.Compare(b.D, a.D) })
	for _, r := range worst[:min(3, len(worst))] {
		during := cmp.Or(r.During, "no broker fault")
		fmt.Fprintf(out, "  %s killed at +%v: %s (%s)\n", r.Slot, h.offset(r.At), secs(r.D), during)
	}
}

// faultsCopy copies the faults; h.mu is held.
func (h *harness) faultsCopy() []Fault {
	out := make([]Fault, len(h.faults))
	for i, f := range h.faults {
		out[i] = *f
	}
	return out
}

// percentile is the p-th percentile (0–100, nearest rank) of ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}
