package loadgen

import (
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/shop-ref/shop/internal/cli"
)

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// progress shows how far the run is: a bar redrawn in place on a terminal,
// a line every few seconds otherwise. The returned func stops it.
func (g *generator) progress(start time.Time, n int) (stop func()) {
	tty := isTerminal(g.out)
	every := 5 * time.Second
	if tty {
		every = 200 * time.Millisecond
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	var rate float64 // only the progress goroutine calls line
	line := func() string {
		c, f, d := g.created.Load(), g.failed.Load(), g.completed.Load()
		el := time.Since(start)
		if c+f < int64(n) || rate == 0 {
			rate = float64(c) / max(el.Seconds(), 1e-9) // frozen once every order is created
		}
		if !g.cfg.follow { // nothing is followed: no completion to count
			return fmt.Sprintf("%d/%d created, %d failed, %.1f orders/s, %s",
				c, n, f, rate, el.Round(100*time.Millisecond))
		}
		return fmt.Sprintf("%d/%d created, %d failed, %d completed, %.1f orders/s, %s",
			c, n, f, d, rate, el.Round(100*time.Millisecond))
	}
	go func() {
		defer close(finished)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				if tty {
					fmt.Fprintf(g.out, "\r%s %s\033[K\n", bar(g.settled.Load()+g.failed.Load(), int64(n), 30), line())
				}
				return
			case <-t.C:
				if tty {
					fmt.Fprintf(g.out, "\r%s %s\033[K", bar(g.settled.Load()+g.failed.Load(), int64(n), 30), line())
				} else {
					fmt.Fprintf(g.out, "loadgen: %s\n", line())
				}
			}
		}
	}()
	return func() { close(done); <-finished }
}

// bar draws [=====>    ] for done of total.
func bar(done, total int64, width int) string {
	filled := int(float64(width) * float64(done) / float64(max(total, 1)))
	filled = min(max(filled, 0), width)
	s := strings.Repeat("=", filled)
	if filled < width {
		s += ">" + strings.Repeat(" ", width-filled-1)
	}
	return "[" + s + "]"
}

// percentile returns the nearest-rank p-th percentile of sorted ds.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func fmtDur(d time.Duration) string { return cli.RoundDuration(d).String() }

func (g *generator) report(runs []orderRun, start, creationEnd time.Time, total time.Duration, timedOut bool) {
	var createLat, toDone []time.Duration
	counts := map[string]int{}
	for _, r := range runs {
		switch {
		case r.created:
			createLat = append(createLat, r.createLat)
			counts[r.status]++
			if r.toDone > 0 {
				toDone = append(toDone, r.toDone)
			}
		case r.failed != nil:
			counts["(failed)"]++
		default:
			counts["(not started)"]++
		}
	}
	slices.Sort(createLat)
	slices.Sort(toDone)
	w := g.out
	rate := "unlimited"
	if g.cfg.rate > 0 {
		rate = fmt.Sprintf("%g/s", g.cfg.rate)
	}
	// Only what was measured: with -follow=false no order was paid or
	// polled, so neither the pay fraction nor a final status applies.
	pay := fmt.Sprintf(", pay %g%%", g.cfg.pay*100)
	if !g.cfg.follow {
		pay = ", -follow=false: creation only"
	}
	fmt.Fprintf(w, "\nloadgen: %d orders against %s (concurrency %d, rate %s%s), %s",
		len(runs), g.cfg.orderURL, g.cfg.concurrency, rate, pay, total.Round(time.Millisecond))
	if timedOut {
		fmt.Fprintf(w, " (stopped by -timeout %v)", g.cfg.timeout)
	}
	fmt.Fprintln(w)
	ok := len(createLat)
	fmt.Fprintf(w, "orders created:    %d ok, %d failed (%d retried requests)\n", ok, g.failed.Load(), g.retried.Load())
	if e, _ := g.firstErr.Load().(string); e != "" {
		fmt.Fprintf(w, "first error:       %s\n", e)
	}
	el := creationEnd.Sub(start)
	fmt.Fprintf(w, "creation:          %d in %s = %.1f orders/s\n", ok, el.Round(time.Millisecond), float64(ok)/max(el.Seconds(), 1e-9))
	if ok > 0 {
		fmt.Fprintf(w, "creation latency:  p50 %s  p90 %s  p99 %s  max %s\n",
			fmtDur(percentile(createLat, .5)), fmtDur(percentile(createLat, .9)), fmtDur(percentile(createLat, .99)), fmtDur(createLat[len(createLat)-1]))
	}
	if !g.cfg.follow {
		return
	}
	fmt.Fprintf(w, "payments:          %d taken, %d refused (each made the moment its order said WAIT_PAY)\n", g.payments.Load(), g.refused.Load())
	if len(toDone) > 0 {
		fmt.Fprintf(w, "order→COMPLETED:   %d completed  p50 %s  p99 %s  max %s\n",
			len(toDone), fmtDur(percentile(toDone, .5)), fmtDur(percentile(toDone, .99)), fmtDur(toDone[len(toDone)-1]))
	} else {
		fmt.Fprintf(w, "order→COMPLETED:   0 completed\n")
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, counts[k]))
	}
	fmt.Fprintf(w, "final status:      %s\n", strings.Join(parts, ", "))
}
