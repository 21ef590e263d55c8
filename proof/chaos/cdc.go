package chaos

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/proof/pgcluster"
)

// The cdc lane's faults, as the report names them. Its SIGKILLs of
// streaming relays are counted apart (Result.RelayKills), as the process
// lane's are.
const (
	KindSlotDrop  = "slot dropped"     // outbox.DropSlot of a service's slot: its walsender terminated, slot and publication gone
	KindPGRestart = "Postgres restart" // the run's private Postgres stopped (-m fast or immediate) and started again
)

// slotsBack is how long every slot may take to be streamed again after a
// fault of the cdc lane.
const slotsBack = time.Minute

// RelayKillsWanted is how many streaming relays the cdc lane must kill in
// a run of d: 20 in three minutes.
func RelayKillsWanted(d time.Duration) int64 { return int64(d / (9 * time.Second)) }

// cdcLane, with every relay in ModeCDC, SIGKILLs the process whose relay
// streams a service's slot every few seconds (its standby copy takes the
// slot over), and at fixed points of the run drops a slot (the relay
// makes it again and backfills from its outbox table) and restarts
// Postgres, -m fast and later -m immediate (the slots come back at the
// position last saved, behind what the relays had confirmed: they stream
// again what was already published). The run's end checks (nothing lost
// from a stream, nothing applied twice, the invariants) then cover it.
//
// Only the run's private cluster is restarted (Config.Lanes with cdc puts
// the run's database on one, see harness.database); the shared test
// server never is.
func (h *harness) cdcLane(ctx context.Context) {
	if err := h.waitSlots(ctx, slotsBack); err != nil {
		h.t.Errorf("cdc lane: %v (do the shop processes honour RELAY_MODE=cdc?)", err)
		return
	}
	d := h.cfg.Duration
	type step struct {
		at   time.Duration
		run  func(context.Context)
		done bool
	}
	names := h.cfg.Services.Names()
	steps := []*step{
		{at: d / 5, run: func(ctx context.Context) { h.dropSlot(ctx, names[0]) }},
		{at: 2 * d / 5, run: func(ctx context.Context) { h.restartPostgres(ctx, pgcluster.Fast) }},
		{at: 3 * d / 5, run: func(ctx context.Context) { h.dropSlot(ctx, names[1%len(names)]) }},
		{at: 4 * d / 5, run: func(ctx context.Context) { h.restartPostgres(ctx, pgcluster.Immediate) }},
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(2500+mrand.IntN(2500)) * time.Millisecond):
		}
		el := time.Since(h.chaosStart)
		i := slices.IndexFunc(steps, func(s *step) bool { return !s.done && el >= s.at })
		if i < 0 {
			h.killRelay(ctx)
			continue
		}
		steps[i].done = true
		steps[i].run(ctx)
	}
}

// slotName is the replication slot of service's outbox in the run.
func (h *harness) slotName(service string) string {
	e, err := h.cfg.Services.Get(service)
	if err != nil {
		panic(err) // the harness names only the shop's own services
	}
	return outbox.SlotName(h.dbName, e.Schema)
}

// streamers maps each slot that is streamed now to the application name
// of the connection streaming it: the name of the relay that streams it
// (outbox.Config.Name), which the relay gives its replication connection.
func (h *harness) streamers(ctx context.Context) (map[string]string, error) {
	rows, err := h.admin.Query(ctx, `
		SELECT s.slot_name, coalesce(a.application_name, '') FROM pg_replication_slots s
		JOIN pg_stat_activity a ON a.pid = s.active_pid
		WHERE s.database = $1`, h.dbName)
	if err != nil {
		return nil, fmt.Errorf("read streamed slots: %w", err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var slot, app string
		if err := rows.Scan(&slot, &app); err != nil {
			return nil, err
		}
		out[slot] = app
	}
	return out, rows.Err()
}

// waitSlots waits until every service's slot is streamed, and says which
// are not when timeout passes.
func (h *harness) waitSlots(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		active, err := h.streamers(ctx)
		var missing []string
		for _, name := range h.cfg.Services.Names() {
			if _, ok := active[h.slotName(name)]; !ok {
				missing = append(missing, name)
			}
		}
		if err == nil && len(missing) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("slots not streamed after %v: %v (last error: %v)", timeout, missing, err)
		}
		if !sleepCtx(ctx, 200*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// killRelay SIGKILLs the process streaming one service's slot, picked at
// random among the slots streamed now.
func (h *harness) killRelay(ctx context.Context) {
	active, err := h.streamers(ctx)
	if err != nil {
		return // Postgres restarting: the next step tries again
	}
	apps := make([]string, 0, len(active))
	for _, app := range active {
		apps = append(apps, app)
	}
	for _, i := range mrand.Perm(len(apps)) {
		pid, ok := relayPID(apps[i])
		if !ok {
			continue
		}
		j := slices.IndexFunc(h.slots, func(s *slot) bool { return s.pid() == pid })
		if j < 0 {
			continue
		}
		s := h.slots[j]
		if s.kill() {
			h.relayKills.Add(1)
			h.mu.Lock()
			h.kills = append(h.kills, kill{slot: s.name, service: s.service, at: time.Now()})
			h.mu.Unlock()
			return
		}
	}
}

// dropSlot drops service's slot as an operator could, and notes when a
// relay streams a new one.
func (h *harness) dropSlot(ctx context.Context, service string) {
	name := h.slotName(service)
	f := h.begin(KindSlotDrop, name)
	heal := context.WithoutCancel(ctx)
	if err := outbox.DropSlot(heal, h.shop.Pools[service], name); err != nil {
		h.healed(f, "NOT dropped: "+err.Error())
		return
	}
	h.healed(f, "dropped; "+h.slotsBack(heal, f.Start))
}

// restartPostgres restarts the run's private Postgres with mode: every
// connection of every process ends, new ones are refused until it is
// back, and the slots come back at the position they last saved.
func (h *harness) restartPostgres(ctx context.Context, mode pgcluster.Mode) {
	heal, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	f := h.begin(KindPGRestart, "-m "+string(mode))
	if err := h.pg.Restart(heal, mode); err != nil {
		h.t.Errorf("restart the run's Postgres -m %s: %v", mode, err)
		h.healed(f, "NOT restarted: "+err.Error())
		return
	}
	back := time.Since(f.Start)
	h.healed(f, fmt.Sprintf("up again after %.1fs; %s", back.Seconds(), h.slotsBack(heal, f.Start)))
}

// slotsBack waits until every slot is streamed again, for the note.
func (h *harness) slotsBack(ctx context.Context, since time.Time) string {
	if err := h.waitSlots(ctx, slotsBack); err != nil {
		h.logf("chaos: %v", err)
		return "NOT every slot streamed again: " + err.Error()
	}
	return fmt.Sprintf("every slot streamed again %.1fs after", time.Since(since).Seconds())
}

// readSlots reads every service's slot at the end of a cdc run.
func (h *harness) readSlots(ctx context.Context) ([]outbox.SlotStats, error) {
	var out []outbox.SlotStats
	for _, name := range h.cfg.Services.Names() {
		st, err := outbox.ReadSlot(ctx, h.shop.Pools[name], h.slotName(name))
		if err != nil {
			return nil, fmt.Errorf("read the slot of %s: %w", name, err)
		}
		out = append(out, st)
	}
	return out, nil
}

// relayPID is the process id in a relay's default name, host-pid-random
// (outbox.Config.Name): the shop's relays take the default.
func relayPID(name string) (int, bool) {
	parts := strings.Split(name, "-")
	if len(parts) < 3 {
		return 0, false
	}
	pid, err := strconv.Atoi(parts[len(parts)-2])
	return pid, err == nil
}
