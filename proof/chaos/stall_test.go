package chaos

import (
	"testing"
	"time"
)

// TestStall checks the stall's definition on a made-up history: gaps count
// only while an order is in flight, from the first such moment, and a gap
// that reaches the end of the window is open.
func TestStall(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	sp := spans{
		orders: []span{
			{created: at(0), ended: at(2)},
			{created: at(5)}, // never ended
		},
		moves: []time.Time{at(1), at(2), at(9)},
	}
	for _, tc := range []struct {
		name     string
		from, to float64
		want     Stall
	}{
		// 2 → 5 nothing is in flight; the stall runs from the creation at 5 to the move at 9.
		{"from the first order in flight", 0, 12, Stall{D: 4 * time.Second, From: at(5), To: at(9)}},
		{"open at the end of the window", 0, 20, Stall{D: 11 * time.Second, From: at(9), To: at(20), Open: true}},
		{"nothing in flight", 2.5, 4.5, Stall{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := sp.stall(at(tc.from), at(tc.to)); got != tc.want {
				t.Errorf("stall(%v, %v) = %+v, want %+v", tc.from, tc.to, got, tc.want)
			}
		})
	}
}

// TestStalls checks the windows: a fault's ends where the next fault of
// its lane starts, a fault of another lane does not cut it, and the
// longest order wait counts the part of each wait inside it.
func TestStalls(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	sp := spans{
		orders: []span{{created: at(0)}},
		moves:  []time.Time{at(30)},
		waits:  []span{{created: at(1), ended: at(4)}, {created: at(3), ended: at(15)}, {created: at(12), ended: at(30)}},
	}
	faults := []Fault{
		{Kind: KindLeaderKill, Start: at(0), Heal: at(5)},
		{Kind: KindPartition, Start: at(2), Heal: at(8)},
		{Kind: KindQuorumLoss, Start: at(10), Heal: at(20)},
	}
	got := sp.stalls(faults, at(100))
	want := []struct {
		until     time.Time
		orderWait time.Duration
	}{
		{at(10), 7 * time.Second},  // cut by the quorum loss, not by the partition; the wait from 3 counts until 10
		{at(68), 18 * time.Second}, // heal + stallAfter
		{at(80), 18 * time.Second}, // the wait from 3 counts from 10 on: 5s
	}
	for i, w := range want {
		if got[i].Until != w.until || got[i].OrderWait != w.orderWait {
			t.Errorf("fault %d (%s): window until %v, order wait %v; want %v, %v",
				i, faults[i].Kind, got[i].Until.Sub(t0), got[i].OrderWait, w.until.Sub(t0), w.orderWait)
		}
	}
}
