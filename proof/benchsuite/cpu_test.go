//go:build shopbench

package benchsuite

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// cpuSample is the machine's cumulative CPU time from the first line of
// /proc/stat, in clock ticks (USER_HZ, 100 per second on Linux): busy is
// user, nice, system, irq and softirq; idle is idle and iowait; steal is
// time the hypervisor gave to someone else. The rows that print CPU figures
// use it to show what bounds them: a row whose machine is ~100 % busy is
// bound by CPU, not by waiting.
type cpuSample struct{ busy, idle, steal float64 }

const ticksPerSecond = 100

func readCPU() cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuSample{}
	}
	v := func(i int) float64 { x, _ := strconv.ParseFloat(f[i], 64); return x }
	return cpuSample{busy: v(1) + v(2) + v(3) + v(6) + v(7), idle: v(4) + v(5), steal: v(8)}
}

// busyShare is the share of the machine's CPU time between a and b that
// was busy, in percent (0 if /proc/stat could not be read).
func busyShare(a, b cpuSample) float64 {
	total := (b.busy - a.busy) + (b.idle - a.idle) + (b.steal - a.steal)
	if total <= 0 {
		return 0
	}
	return 100 * (b.busy - a.busy) / total
}

// processCPU is the user and system CPU this process has used so far, in
// seconds (0 if it cannot be read).
func processCPU() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

// busySeconds is the busy CPU time between a and b, summed over all cores.
func busySeconds(a, b cpuSample) float64 { return (b.busy - a.busy) / ticksPerSecond }

func TestBusyShare(t *testing.T) {
	a := cpuSample{busy: 100, idle: 300, steal: 0}
	b := cpuSample{busy: 250, idle: 350, steal: 0} // 150 busy, 50 idle ticks between them
	if got := busyShare(a, b); got != 75 {
		t.Errorf("busyShare = %v, want 75", got)
	}
	if got := busySeconds(a, b); got != 1.5 {
		t.Errorf("busySeconds = %v, want 1.5", got)
	}
	if got := busyShare(b, b); got != 0 {
		t.Errorf("busyShare of no time = %v, want 0", got)
	}
	now := readCPU()
	if now.busy <= 0 || now.idle <= 0 {
		t.Fatalf("readCPU = %+v; /proc/stat unreadable?", now)
	}
}
