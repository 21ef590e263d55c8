package cli

import (
	"strings"
	"time"
)

// RoundDuration keeps a duration readable in a command's output.
func RoundDuration(d time.Duration) time.Duration {
	switch {
	case d >= time.Minute:
		return d.Round(time.Second)
	case d >= time.Second:
		return d.Round(10 * time.Millisecond)
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond)
	}
	return d
}

// OneLine shortens s to one line of at most n runes.
func OneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

// DropSlotCommand is the command line that drops service's replication
// slot and publication (shop slots drop): what a polling relay's warning,
// /readyz and shop verify name for a slot left behind.
func DropSlotCommand(service string) string { return "shop slots drop --service " + service }
