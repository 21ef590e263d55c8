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
	WALStatus string // pg_replication_slots.wal_status: reserved, extended, unreserved or lost
	// LagBytes is the WAL the server keeps for the slot: from its
	// confirmed position to the server's current one.
	LagBytes int64
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
	var walStatus *string
	var safe *int64
	var age *time.Duration
	err := db.QueryRow(ctx, `
		SELECT s.active, s.wal_status,
		       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn), 0)::bigint,
		       s.safe_wal_size,
		       (SELECT now() - caught_up_at FROM outbox_slots WHERE slot = s.slot_name)
		FROM pg_replication_slots s WHERE s.slot_name = $1`, slot).Scan(&s.Active, &walStatus, &s.LagBytes, &safe, &age)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil
	}
	if err != nil {
		return SlotStats{}, fmt.Errorf("read outbox slot %s: %w", slot, err)
	}
	s.Exists = true
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
	// The walsender holding the slot must go first, or the drop fails;
	// a relay may reconnect in between, so try a few times.
	for try := 0; ; try++ {
		_, err := db.Exec(ctx, `
			SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
			WHERE slot_name = $1 AND active_pid IS NOT NULL`, slot)
		if err == nil {
			_, err = db.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot)
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" && try < 20 { // object_in_use: a relay took it back
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
