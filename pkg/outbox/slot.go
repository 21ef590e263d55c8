package outbox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Mode is how a relay finds the events to publish.
type Mode string

const (
	// ModePoll claims due events from the outbox table (the default).
	ModePoll Mode = "poll"
	// ModeCDC reads committed outbox inserts from a logical replication
	// slot, in commit order, and polls only for the events the stream
	// leaves to the table (see Config.HandOff).
	ModeCDC Mode = "cdc"
)

// SlotName is the default replication slot, and publication, of the
// outbox in schema of database: "outbox_<database>_<schema>", lowercased,
// other characters than [a-z0-9_] made "_", cut to Postgres's 63 bytes
// with a hash of the whole when longer. Slots are per cluster, so the
// database is in the name: two databases with an "order" schema (the demo
// and a test, say) must not share one.
func SlotName(database, schema string) string {
	full := "outbox_" + database + "_" + schema
	name := strings.Map(func(c rune) rune {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '_':
			return c
		case c >= 'A' && c <= 'Z':
			return c + 'a' - 'A'
		}
		return '_'
	}, full)
	if len(name) <= 63 {
		return name
	}
	h := fnv.New32a()
	h.Write([]byte(full))
	return fmt.Sprintf("%s_%08x", name[:54], h.Sum32())
}

// SlotStats describe a relay's replication slot: how much WAL it holds
// back on the database server, and for how long.
type SlotStats struct {
	Slot      string
	Exists    bool
	Active    bool   // a relay streams it now
	ActivePID int    // the walsender that streams it; 0 when none
	Streamer  string // that walsender's application_name: the relay's Config.Name (cut to 63 bytes)
	WALStatus string // pg_replication_slots.wal_status: reserved, extended, unreserved or lost
	// Publication: the publication of the same name exists (the relay
	// makes it before the slot, and DropSlot drops both).
	Publication bool
	// LagBytes is how far the slot's confirmed position is behind the
	// server's current one: what its relay has yet to settle.
	LagBytes int64
	// RestartLagBytes is the WAL the server keeps for the slot: from its
	// restart position (the oldest WAL decoding may still need) to the
	// server's current one. It is at least LagBytes, and more while a
	// transaction anywhere on the server stays open (OldestXactAge): the
	// restart position cannot pass the oldest one running.
	RestartLagBytes int64
	// OldestXactAge is the age of the oldest transaction open on the
	// server that holds a transaction id (pg_stat_activity.xact_start;
	// prepared ones too); 0 when none. Other roles' sessions are seen only
	// by a role with pg_read_all_stats (or a superuser).
	OldestXactAge time.Duration
	// LagAge is how long ago the streaming relay last had everything it
	// was sent confirmed; 0 when that is unknown (no relay streamed since
	// the slot was made).
	LagAge time.Duration
	// SafeWALSize is how much more WAL may be written before the slot is
	// in danger of being invalidated by max_slot_wal_keep_size; -1 when
	// the server sets no limit (the disk is the limit).
	SafeWALSize int64
}

// ReadSlot reads the slot of the outbox that db's connections use; slot
// "" means SlotName of db's current database and schema. A slot that does
// not exist is no error: Exists is false.
func ReadSlot(ctx context.Context, db DB, slot string) (SlotStats, error) {
	if slot == "" {
		var database, schema string
		if err := db.QueryRow(ctx, `SELECT current_database(), current_schema()`).Scan(&database, &schema); err != nil {
			return SlotStats{}, fmt.Errorf("read outbox slot: %w", err)
		}
		slot = SlotName(database, schema)
	}
	s := SlotStats{Slot: slot, SafeWALSize: -1}
	var oldest *time.Duration
	err := db.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
		       greatest(now() - least(
		           (SELECT min(xact_start) FROM pg_stat_activity WHERE backend_xid IS NOT NULL),
		           (SELECT min(prepared) FROM pg_prepared_xacts)), interval '0')`, slot).Scan(&s.Publication, &oldest)
	if err != nil {
		return SlotStats{}, fmt.Errorf("read outbox slot %s: %w", slot, err)
	}
	if oldest != nil {
		s.OldestXactAge = *oldest
	}
	var walStatus, streamer *string
	var pid *int
	var safe *int64
	var age *time.Duration
	err = db.QueryRow(ctx, `
		SELECT s.active, s.active_pid, (SELECT application_name FROM pg_stat_activity WHERE pid = s.active_pid),
		       s.wal_status,
		       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn), 0)::bigint,
		       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn), 0)::bigint,
		       s.safe_wal_size,
		       (SELECT now() - caught_up_at FROM outbox_slots WHERE slot = s.slot_name)
		FROM pg_replication_slots s WHERE s.slot_name = $1`, slot).
		Scan(&s.Active, &pid, &streamer, &walStatus, &s.LagBytes, &s.RestartLagBytes, &safe, &age)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil
	}
	if err != nil {
		return SlotStats{}, fmt.Errorf("read outbox slot %s: %w", slot, err)
	}
	s.Exists = true
	if pid != nil {
		s.ActivePID = *pid
	}
	if streamer != nil {
		s.Streamer = *streamer
	}
	if walStatus != nil {
		s.WALStatus = *walStatus
	}
	if safe != nil {
		s.SafeWALSize = *safe
	}
	if age != nil {
		s.LagAge = max(*age, 0)
	}
	return s, nil
}

// DropSlot drops a replication slot and its publication, ending the
// stream of the relay that holds it, if any: for operators retiring a
// service, and for tests. A relay in ModeCDC that still runs makes a new
// slot and publishes what the old one had not confirmed from the outbox
// table. Dropping a slot that does not exist is no error.
func DropSlot(ctx context.Context, db DB, slot string) error {
	return dropSlot(ctx, db, slot, true)
}

// ErrSlotActive is DropIdleSlot's answer for a slot a relay streams.
var ErrSlotActive = errors.New("a relay streams the slot")

// DropIdleSlot drops a replication slot and its publication unless a relay
// streams the slot now: then it drops nothing and returns an error that
// is ErrSlotActive. Dropping a slot that does not exist is no error (its
// publication, if any, is dropped).
func DropIdleSlot(ctx context.Context, db DB, slot string) error {
	return dropSlot(ctx, db, slot, false)
}

func dropSlot(ctx context.Context, db DB, slot string, force bool) error {
	// The walsender holding the slot must go first, or the drop fails;
	// a relay may reconnect in between, so try a few times.
	for try := 0; ; try++ {
		var err error
		if force {
			_, err = db.Exec(ctx, `
				SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
				WHERE slot_name = $1 AND active_pid IS NOT NULL`, slot)
		}
		if err == nil {
			_, err = db.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot)
		}
		var pgErr *pgconn.PgError
		inUse := errors.As(err, &pgErr) && pgErr.Code == "55006" // object_in_use: a relay streams it, or took it back
		if inUse && !force {
			return fmt.Errorf("drop outbox slot %s: %w (%v)", slot, ErrSlotActive, err)
		}
		if inUse && try < 20 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("drop outbox slot %s: %w", slot, err)
		}
		break
	}
	if _, err := db.Exec(ctx, `DROP PUBLICATION IF EXISTS `+pgx.Identifier{slot}.Sanitize()); err != nil {
		return fmt.Errorf("drop outbox publication %s: %w", slot, err)
	}
	if _, err := db.Exec(ctx, `DELETE FROM outbox_slots WHERE slot = $1`, slot); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42P01" { // undefined_table: the schema is gone
			return fmt.Errorf("forget outbox slot %s: %w", slot, err)
		}
	}
	return nil
}

// Leftover slots are looked for every leftoverSlotEvery, and warned of
// again every leftoverSlotRepeat while they stay.
const (
	leftoverSlotEvery  = time.Minute
	leftoverSlotRepeat = time.Hour
)

// watchLeftoverSlot, in ModePoll, warns while the relay's slot exists.
// Failure window: a service switched from ModeCDC to ModePoll leaves its
// slot, which no relay confirms any more: it keeps every byte of WAL the
// server writes from then on (75 MB in an hour of a test run, growing)
// until the disk fills or max_slot_wal_keep_size invalidates it, and with
// it Postgres will not start with wal_level below logical. Nothing but an
// operator drops it (a relay cannot tell a slot left for good from one a
// copy in ModeCDC is about to stream again), so the warning names the way
// (Config.SlotDropHint); metrics and /readyz show it too
// (TestPollingRelayWarnsOfItsLeftoverSlot).
func (r *Relay) watchLeftoverSlot(ctx context.Context) {
	var warned time.Time
	for {
		ss, err := ReadSlot(ctx, r.pool, r.slot)
		switch {
		case err != nil:
			r.log.Debug("outbox relay: cannot read the slot", "slot", r.slot, "err", err)
		case !ss.Exists || ss.Active:
			// None, or a copy still in ModeCDC streams it (a switch
			// under way): not left yet.
			warned = time.Time{}
		case warned.IsZero() || time.Since(warned) >= leftoverSlotRepeat:
			warned = time.Now()
			r.log.Warn("outbox relay: the relay polls, but its replication slot from cdc mode is still there, holding WAL "+
				"that no relay will confirm; drop it: "+r.cfg.SlotDropHint, "slot", r.slot, "wal_held_bytes", ss.RestartLagBytes)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(leftoverSlotEvery):
		}
	}
}

// StreamBlockers says why no relay using db's role can stream slot from
// db's server now, each reason naming the setting or privilege and its
// value; none when nothing is in the way: wal_level not logical, or
// changed for the next restart while the slot exists (Postgres will not
// start then, unless the new value is logical); a role that may not
// replicate; every WAL sender in use; every replication slot taken while
// slot is missing. For operators (shop verify), whose advice for a slot
// nobody confirms must name the setting, not guess. A relay says the same
// of itself when it cannot stream (State().CDCUnavailable).
func StreamBlockers(ctx context.Context, db DB, slot string) ([]string, error) {
	var (
		level                           string
		levelPending, replicate, exists bool
		senders, maxSenders             int
		slots, maxSlots                 int
		role                            string
	)
	err := db.QueryRow(ctx, `
		SELECT (SELECT setting FROM pg_settings WHERE name = 'wal_level'),
		       (SELECT pending_restart FROM pg_settings WHERE name = 'wal_level'),
		       current_user, (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
		       (SELECT count(*) FROM pg_stat_replication), current_setting('max_wal_senders')::int,
		       (SELECT count(*) FROM pg_replication_slots), current_setting('max_replication_slots')::int,
		       EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)`, slot).
		Scan(&level, &levelPending, &role, &replicate, &senders, &maxSenders, &slots, &maxSlots, &exists)
	if err != nil {
		return nil, fmt.Errorf("read the server's replication settings: %w", err)
	}
	var why []string
	if level != "logical" {
		why = append(why, fmt.Sprintf("wal_level=%s: cdc needs wal_level=logical (ALTER SYSTEM SET wal_level = logical, then restart Postgres)", level))
	}
	if levelPending && exists {
		why = append(why, fmt.Sprintf("wal_level is changed for the next restart of Postgres (pending_restart), and slot %s exists: "+
			"unless the new value is logical, Postgres will not start with it; drop the slot first", slot))
	}
	if !replicate {
		why = append(why, fmt.Sprintf("role %s may not replicate: ALTER ROLE %s REPLICATION", role, pgx.Identifier{role}.Sanitize()))
	}
	if senders >= maxSenders {
		why = append(why, fmt.Sprintf("max_wal_senders=%d, all in use: raise it and restart Postgres, or stream fewer slots from this server", maxSenders))
	}
	if !exists && slots >= maxSlots {
		why = append(why, fmt.Sprintf("max_replication_slots=%d, all taken: raise it and restart Postgres, or drop slots nothing streams", maxSlots))
	}
	return why, nil
}
