package outbox

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Shard ownership (Config.ShardOwnership): each relay worker is a member
// that leases hash shards of the aggregates (outbox_shards) and reads the
// events of its shards alone, without writing a claim on every row. This
// file keeps a member's shards; batch.go reads and settles them.

// shardCount is the number of shards, seeded by migration 00002; shardExpr
// is an event's shard, the expression of that migration's index.
const (
	shardCount = 32
	shardExpr  = `(hashtext(o.aggregate_type || '/' || o.aggregate_id) & 31)`
)

// shardRound is how often at most a member that owns shards renews them
// and looks for members that came or went: often enough that a relay that
// joins gets its share within a fraction of a second, not a lease later.
// A round is one batch of three small statements.
const shardRound = 250 * time.Millisecond

// member is one worker's share of the shards.
type member struct {
	name    string    // unique per worker and per run: a restarted relay never adopts a lease it cannot know about
	shards  []int32   // owned now, ascending
	epochs  []int64   // the epoch each was taken under
	renewed time.Time // when the leases were last renewed
}

// fence is what a batch was read under: the claim token of per-row claims,
// or the member's shards and their epochs.
type fence struct {
	token  uuid.UUID
	member *member
	shards []int32
	epochs []int64
}

func newMember(relay string, worker int) *member {
	return &member{name: fmt.Sprintf("%s/%d/%04x", relay, worker, rand.Uint32()&0xffff)}
}

// own renews m's leases, gives back what exceeds its fair share and takes
// free or expired shards up to it. It runs between batches, so nothing read
// under a shard it gives back is in flight. The fair share is the shards
// divided by the live members, rounded up, so every shard finds an owner.
func (r *Relay) own(ctx context.Context, m *member) error {
	if len(m.shards) > 0 && time.Since(m.renewed) < min(r.cfg.LeaseDuration/3, shardRound) {
		return nil
	}
	lease := r.cfg.LeaseDuration.Microseconds()
	b := &pgx.Batch{}
	b.Queue(heartbeatSQL, m.name, lease)
	var live int
	b.Queue(liveSQL).QueryRow(func(row pgx.Row) error { return row.Scan(&live) })
	var shards []int32
	var epochs []int64
	b.Queue(renewSQL, m.name, lease).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var s int32
			var e int64
			if err := rows.Scan(&s, &e); err != nil {
				return err
			}
			shards, epochs = append(shards, s), append(epochs, e)
		}
		return rows.Err()
	})
	if err := r.pool.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("renew outbox shards: %w", err)
	}
	m.renewed = time.Now()
	m.shards, m.epochs = shards, epochs
	sortShards(m)
	shards, epochs = m.shards, m.epochs
	fair := (shardCount + max(live, 1) - 1) / max(live, 1)
	switch {
	case len(shards) > fair:
		// Gives back the highest: a newcomer takes them at its next round.
		if _, err := r.pool.Exec(ctx, releaseShardsSQL, m.name, shards[fair:]); err != nil {
			return fmt.Errorf("give back outbox shards: %w", err)
		}
		shards, epochs = shards[:fair], epochs[:fair]
	case len(shards) < fair:
		rows, err := r.pool.Query(ctx, takeShardsSQL, m.name, lease, fair-len(shards))
		if err != nil {
			return fmt.Errorf("take outbox shards: %w", err)
		}
		for rows.Next() {
			var s int32
			var e int64
			var takeover bool
			if err := rows.Scan(&s, &e, &takeover); err != nil {
				rows.Close()
				return fmt.Errorf("take outbox shards: %w", err)
			}
			if takeover {
				r.stats.takenOver.Add(1)
				r.log.Info("outbox shard taken over from an expired owner", "shard", s, "epoch", e)
			}
			shards, epochs = append(shards, s), append(epochs, e)
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("take outbox shards: %w", err)
		}
	}
	m.shards, m.epochs = shards, epochs
	sortShards(m)
	return nil
}

func sortShards(m *member) {
	idx := make([]int, len(m.shards))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return int(m.shards[a] - m.shards[b]) })
	s, e := make([]int32, len(idx)), make([]int64, len(idx))
	for i, j := range idx {
		s[i], e[i] = m.shards[j], m.epochs[j]
	}
	m.shards, m.epochs = s, e
}

// leave gives m's shards back when its relay stops, so that the others take
// them at their next round instead of after the lease.
func (r *Relay) leave(ctx context.Context, m *member) {
	if _, err := r.pool.Exec(ctx, leaveSQL, m.name); err != nil {
		r.log.Warn("outbox relay: cannot give its shards back; they move when the lease expires", "err", err)
	}
}

const heartbeatSQL = `
WITH gone AS (DELETE FROM outbox_relays WHERE alive_until < now() - interval '1 minute')
INSERT INTO outbox_relays (name, alive_until) VALUES ($1, now() + $2 * interval '1 microsecond')
ON CONFLICT (name) DO UPDATE SET alive_until = EXCLUDED.alive_until`

const liveSQL = `SELECT count(*) FROM outbox_relays WHERE alive_until > now()`

// renewSQL extends the leases m still holds. A shard that another member
// took (its lease had expired) no longer names m and is not renewed.
const renewSQL = `
UPDATE outbox_shards SET lease_until = now() + $2 * interval '1 microsecond'
WHERE owner = $1
RETURNING shard, epoch`

const releaseShardsSQL = `
UPDATE outbox_shards SET owner = NULL, lease_until = NULL
WHERE owner = $1 AND shard = ANY($2)`

const leaveSQL = `
WITH shards AS (UPDATE outbox_shards SET owner = NULL, lease_until = NULL WHERE owner = $1)
DELETE FROM outbox_relays WHERE name = $1`

// takeShardsSQL takes free shards and shards whose lease expired, each
// under a new epoch: from here on the earlier owner's updates match
// nothing. SKIP LOCKED passes over a shard whose owner is marking it now.
const takeShardsSQL = `
WITH free AS (
	SELECT shard, owner IS NOT NULL AS takeover FROM outbox_shards
	WHERE owner IS NULL OR lease_until < now()
	ORDER BY shard
	LIMIT $3
	FOR UPDATE SKIP LOCKED
)
UPDATE outbox_shards s
SET owner = $1, epoch = s.epoch + 1, lease_until = now() + $2 * interval '1 microsecond'
FROM free
WHERE s.shard = free.shard
RETURNING s.shard, s.epoch, free.takeover`

// readShardsSQL reads a batch of the member's shards, in event order: the
// oldest unpublished event of each aggregate, due. It writes nothing: the
// shard's lease, not a claim per row, keeps the other relays off. A row
// still leased by a per-row claim is left alone.
const readShardsSQL = `
SELECT o.event_id, o.aggregate_type, o.aggregate_id, o.aggregate_seq, o.event_type,
       o.schema_version, o.subject, o.payload, o.headers, o.occurred_at, o.attempts, false
FROM outbox o
WHERE ` + shardExpr + ` = ANY($2::int[])
  AND o.published_at IS NULL AND o.dead_at IS NULL
  AND ` + dueSQL + `
ORDER BY o.event_id
LIMIT $1`

// ownedSQL is the fence of the shard updates below: the shards the member
// still owns under the epochs it read them in, share-locked so that no
// takeover commits while the update runs (takeShardsSQL passes over a
// locked shard), and a takeover that committed first leaves the update
// nothing to match.
const ownedSQL = `
WITH owned AS (
	SELECT s.shard FROM outbox_shards s
	JOIN unnest($2::int[], $3::bigint[]) AS h(shard, epoch) ON h.shard = s.shard AND h.epoch = s.epoch
	WHERE s.owner = $4
	FOR SHARE OF s
)`

const markShardsSQL = ownedSQL + `
UPDATE outbox o
SET published_at = now()
FROM owned
WHERE o.event_id = ANY($1) AND ` + shardExpr + ` = owned.shard AND o.published_at IS NULL`

const failShardsSQL = ownedSQL + `
UPDATE outbox o
SET attempts = attempts + 1,
    last_error = $5,
    available_at = now() + $6 * interval '1 microsecond',
    dead_at = CASE WHEN $7 THEN now() END
FROM owned
WHERE o.event_id = $1 AND ` + shardExpr + ` = owned.shard AND o.published_at IS NULL`
