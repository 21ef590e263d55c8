package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/nats-io/nats.go"
)

// ModeCDC: the relay reads the outbox's inserts from a logical replication
// slot (pgoutput, a publication of the outbox table alone), in commit
// order, and publishes them as the poller does: same subject, headers and
// Nats-Msg-Id. docs/architecture.md tells the design; the windows it
// closes are in docs/failure-windows.md.
//
// The slot's confirmed position is the stream's record: the relay
// confirms a position only when every event committed at or before it is
// acked by the broker and marked published in the table, so a relay that
// dies anywhere resumes from a position behind which nothing is missing,
// and publishes the rest again under the same ids. The marks keep the
// table the source of truth for everything else (status, verify, the
// journey, retention, the backfill of a lost slot).
//
// Order per aggregate follows from commit order: the writer numbers an
// aggregate's events under its counter row's lock (Writer.Add), so event
// k+1's transaction cannot commit before k's, and the slot sends
// transactions in commit order. The relay then publishes k+1 only after
// k's ack: at most one event of an aggregate per batch, and only when k was
// acked in this stream or is published in the table. When k is not (it
// failed on its own, or the stream started after it), k+1 is left to the
// table, where the poller publishes it after k (Config.HandOff).

const (
	// statusInterval is how often the relay tells the server its
	// confirmed position, and asks for the server's (an idle outbox
	// follows the WAL that other schemas write, so it pins none).
	statusInterval = time.Second
	// cdcRetryInterval spaces the tries of a relay for which CDC cannot
	// run (a setting is missing); it polls meanwhile.
	cdcRetryInterval = 10 * time.Second
	// rememberedAcks bounds the stream's memory of acked aggregates;
	// past it the memory starts again, and the table answers instead.
	rememberedAcks = 100_000
	// streamTimeout is the wal_sender_timeout of the relay's own
	// replication connection: a walsender whose relay has not reported
	// for this long ends, freeing the slot. Failure window: a streaming
	// process that hangs (SIGSTOP, a stuck host) keeps its walsender, and
	// so the slot, for the server's wal_sender_timeout (60 s by default),
	// every event of the service waiting meanwhile. The relay reports every
	// statusInterval, so only a relay stalled this long loses its stream
	// (TestCDCFrozenStreamerIsTakenOver). A standby usually ends a frozen
	// streamer's walsender sooner (endStaleStream); this is for when it
	// cannot.
	streamTimeout = 5 * time.Second
)

// cdcState is a relay's stream, shared with State and the heartbeat.
type cdcState struct {
	streaming   atomic.Bool
	unavailable atomic.Pointer[string] // why ModeCDC cannot stream here; nil: it can
	caughtUpAt  atomic.Int64           // unix nanoseconds: last time everything sent was confirmed
	handedOff   atomic.Int64           // events the stream left to the table
	markWaits   atomic.Int64           // acked events whose rows the first mark could not see yet
	// cannotEndLogged: endStaleStream has said it may not end a stale
	// walsender.
	cannotEndLogged atomic.Bool
	// backfillBefore is when this relay made the slot (the database's
	// clock): events due before it are in no stream, and its poller
	// publishes them at once, not after the HandOff. Nil: it made none.
	backfillBefore atomic.Pointer[time.Time]
}

// standbyError: another relay streams the slot; this one waits its turn.
type standbyError struct{ err error }

func (e *standbyError) Error() string { return "slot in use: " + e.err.Error() }

// brokenSlotError: the slot can never stream the outbox again. Failure
// window: its publication was dropped (by shop slots drop racing the
// relay that makes the slot again, or by hand), or made after the slot.
// pgoutput reads the publication as of each change it decodes, so the
// first change of the database after that point fails the stream with
// "publication does not exist", and so does every stream started again
// from the slot's confirmed position, even once the publication is back:
// the slot stays unconfirmed, holding WAL, while every event waits the
// HandOff. An idle database has such a change within aliveEvery too: the
// relay's own heartbeat. The relay drops the slot, makes the publication
// and then the slot, and publishes what the old slot had not confirmed
// from the table (TestCDCSlotOlderThanItsPublication,
// TestCDCPublicationDroppedMidStream, TestCDCPublicationDroppedWhileIdle).
type brokenSlotError struct{ err error }

func (e *brokenSlotError) Error() string {
	return "the slot cannot stream the outbox: " + e.err.Error()
}

// unavailableCDCError: the database cannot serve ModeCDC as configured.
type unavailableCDCError struct{ reason string }

func (e *unavailableCDCError) Error() string { return e.reason }

// handOff is how old an event must be before the relay's poller takes it.
func (r *Relay) handOff() time.Duration {
	if r.cfg.Mode != ModeCDC || r.cdc.unavailable.Load() != nil {
		return 0
	}
	return r.cfg.HandOff
}

// stream streams the slot until ctx ends, standing by while another relay
// streams it, and polling while the database cannot serve ModeCDC.
func (r *Relay) stream(ctx context.Context) {
	failures := 0
	remake := false
	for ctx.Err() == nil {
		if remake {
			if err := r.dropBrokenSlot(ctx); err != nil {
				r.log.Warn("outbox relay: cannot drop the slot to make it again; retrying", "slot", r.slot, "err", err)
			} else {
				remake = false
			}
		}
		began := time.Now()
		err := r.streamOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if time.Since(began) > 10*time.Second {
			failures = 0
		}
		var standby *standbyError
		var unavailable *unavailableCDCError
		var broken *brokenSlotError
		wait := r.cfg.PollInterval
		switch {
		case errors.As(err, &broken):
			failures++
			remake = true
			// A WARN: the relay mends it itself, and shop slots drop
			// racing a relay in cdc mode can lead here.
			r.log.Warn("outbox relay: the slot cannot stream the outbox; making its publication and then the slot again, "+
				"and publishing what the slot had not confirmed from the outbox table", "slot", r.slot, "err", err)
			wait = backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, failures, r.jitter)
		case errors.As(err, &unavailable):
			if old := r.cdc.unavailable.Swap(&unavailable.reason); old == nil || *old != unavailable.reason {
				r.log.Error("outbox relay: cannot stream the outbox by CDC; polling the table until it can", "reason", unavailable.reason)
				// The HandOff is off now: the poller takes what waits at
				// once, not at its next poll.
				r.wake()
			}
			wait = cdcRetryInterval
		case errors.As(err, &standby):
			r.log.Debug("outbox relay: another relay streams the slot; standing by", "slot", r.slot, "err", err)
			wait = r.cfg.PollInterval/2 + time.Duration(r.jitter(int64(r.cfg.PollInterval/2))+1)
			if r.endStaleStream(ctx) {
				wait = min(wait, staleRetry) // the slot is free as soon as the walsender has exited
			}
		case errors.Is(err, errMarkUnseen):
			// Not confirmed past them: the next stream publishes and marks
			// them again. A transaction that stays invisible long after its
			// commit was sent (a synchronous standby that does not answer)
			// ends every stream here until it is visible.
			failures++
			r.log.Error("outbox relay: published events whose rows stay invisible to the relay; "+
				"starting the stream again from its confirmed position", "slot", r.slot, "err", err)
			wait = backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, failures, r.jitter)
		case err != nil:
			failures++
			if failures == 1 {
				r.log.Warn("outbox relay: the slot's stream ended; starting again from its confirmed position", "slot", r.slot, "err", err)
			}
			wait = backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, failures, r.jitter)
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// streamOnce holds the slot for one stream: from its confirmed position
// until an error or the end of ctx.
func (r *Relay) streamOnce(ctx context.Context) error {
	if err := r.prepareSlot(ctx); err != nil {
		return err
	}
	cc := r.pool.Config().ConnConfig.Copy()
	cc.RuntimeParams["replication"] = "database"
	cc.RuntimeParams["DateStyle"] = "ISO"
	// The walsender is known by the relay's name (pg_stat_activity's
	// application_name), so that a standby can tell whether the relay
	// streaming the slot is still alive (endStaleStream).
	cc.RuntimeParams["application_name"] = r.cfg.Name
	cc.RuntimeParams["wal_sender_timeout"] = strconv.FormatInt(streamTimeout.Milliseconds(), 10) + "ms"
	conn, err := pgconn.ConnectConfig(ctx, &cc.Config)
	if pgErrCode(err) == "42501" {
		// Failure window: a role that may not replicate. Postgres refuses
		// the replication connection itself ("must be superuser or
		// replication role to start walsender"), before any slot command:
		// taken for a passing error, it was retried quietly while every
		// event waited the HandOff. It is the database's setting: say so,
		// and poll (TestCDCRoleThatMayNotReplicateFallsBackToPolling).
		return &unavailableCDCError{fmt.Sprintf("the relay's role may not replicate (ALTER ROLE ... REPLICATION): %v", err)}
	}
	if pgErrCode(err) == "53300" {
		// Failure window: every WAL sender taken (by other services'
		// slots, standbys, base backups). It is the server's setting, not
		// a passing error: retried quietly, the relay would look like a
		// standby while every event waited the HandOff. Say so, with the
		// value, and poll at once (TestCDCOutOfSendersOrSlotsPollsAtOnce).
		return &unavailableCDCError{fmt.Sprintf("no WAL sender is free for the replication connection: max_wal_senders=%s, all in use "+
			"(raise it and restart Postgres, or stream fewer slots from this server): %v", r.setting(ctx, "max_wal_senders"), err)}
	}
	if err != nil {
		return fmt.Errorf("replication connection: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := r.ensureSlot(ctx, conn); err != nil {
		return err
	}
	// The publication may have gone since prepareSlot made sure of it: a
	// slot made then would decode without it.
	if err := r.checkPublication(ctx); err != nil {
		return err
	}
	err = pglogrepl.StartReplication(ctx, conn, r.slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + r.slot + "'"},
	})
	if pgErrCode(err) == "55006" { // object_in_use: another relay streams it
		return &standbyError{err}
	}
	if err != nil {
		return fmt.Errorf("start replication from slot %s: %w", r.slot, err)
	}
	if old := r.cdc.unavailable.Swap(nil); old != nil {
		r.log.Info("outbox relay: streaming by CDC again", "slot", r.slot)
	}
	r.cdc.streaming.Store(true)
	defer r.cdc.streaming.Store(false)
	r.log.Info("outbox relay: streaming the outbox from its slot", "slot", r.slot)

	s := &session{}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	txs := make(chan cdcTx, 64)
	pubDone := make(chan struct{})
	var pubErr error
	go func() {
		defer close(pubDone)
		if pubErr = r.publishStream(sctx, txs, s); pubErr != nil {
			cancel()
		}
	}()
	readErr := r.readStream(sctx, conn, txs, s)
	cancel()
	<-pubDone
	// The last word: what the publisher settled before it stopped.
	_ = sendStatus(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pglogrepl.LSN(s.confirmed.Load())})
	if pubErr != nil {
		return pubErr
	}
	if pgErrCode(readErr) == "42704" { // undefined_object: publication "…" does not exist
		return &brokenSlotError{readErr}
	}
	return readErr
}

// checkPublication returns a brokenSlotError when the slot's publication
// does not exist.
func (r *Relay) checkPublication(ctx context.Context) error {
	var exists bool
	if err := r.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, r.slot).Scan(&exists); err != nil {
		return fmt.Errorf("read publication %s: %w", r.slot, err)
	}
	if !exists {
		return &brokenSlotError{fmt.Errorf("publication %s does not exist", r.slot)}
	}
	return nil
}

// dropBrokenSlot drops the relay's slot after a brokenSlotError, so that
// the next stream makes the publication first and the slot after it. The
// stream that failed may hold the slot for a moment yet; a slot that stays
// streamed is another relay's, which checks the publication itself.
func (r *Relay) dropBrokenSlot(ctx context.Context) error {
	for try := 0; ; try++ {
		var active bool
		err := r.pool.QueryRow(ctx, `SELECT active FROM pg_replication_slots WHERE slot_name = $1`, r.slot).Scan(&active)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read slot %s: %w", r.slot, err)
		}
		if !active {
			_, err := r.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, r.slot)
			switch pgErrCode(err) {
			case "", "42704": // dropped, by us or by another relay
				if err == nil {
					r.log.Warn("outbox relay: dropped the slot that could not stream the outbox", "slot", r.slot)
				}
				return nil
			case "55006": // taken in between
			default:
				return fmt.Errorf("drop slot %s: %w", r.slot, err)
			}
		}
		if try == 40 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// errReplicationClosed: the replication connection broke, and pgconn is
// closing it.
var errReplicationClosed = errors.New("replication connection closed")

// sendStatus reports a position to the server, unless the connection is
// closed. Failure window: after a receive error that is not a timeout,
// pgconn closes the connection in a goroutine of its own (asyncClose),
// which writes a Terminate through the connection's buffer; a status
// update written then races it (-race: TestPostgresRestartMidStream once,
// TestCDCReplicationConnectionCutMidStream within a few runs).
// pgconn marks the connection closed in the goroutine that received, which
// is the stream's, before it starts closing; so a connection that IsClosed
// does not say is not being closed, and one that is gets no write. The
// slot keeps the position last reported, and the next stream starts
// there: nothing behind it is unsettled.
func sendStatus(ctx context.Context, conn *pgconn.PgConn, update pglogrepl.StandbyStatusUpdate) error {
	if conn.IsClosed() {
		return errReplicationClosed
	}
	return pglogrepl.SendStandbyStatusUpdate(ctx, conn, update)
}

// staleRetry is how soon a standby that ended a stale walsender tries
// the slot again.
const staleRetry = 100 * time.Millisecond

// endStaleStreamSQL ends the walsender of the slot when the relay that
// streams it (its application_name, endStaleStream) said it was alive and
// has stopped saying so. A walsender whose relay is unknown (a version
// that did not name it, another client, a relay gone from outbox_relays a
// minute after its last word) is left to wal_sender_timeout.
const endStaleStreamSQL = `
SELECT a.application_name, pg_terminate_backend(s.active_pid)
FROM pg_replication_slots s
JOIN pg_stat_activity a ON a.pid = s.active_pid
JOIN outbox_relays r ON left(r.name, 63) = a.application_name
WHERE s.slot_name = $1 AND r.alive_until < now()`

// endStaleStream ends the stream of a slot whose relay has stopped saying
// it is alive, and reports whether it did. Failure window: a frozen
// streaming process (SIGSTOP, a hung host, a stuck VM) keeps its
// walsender, and so the slot, until the walsender's wal_sender_timeout;
// its heartbeat in outbox_relays stops within aliveFor, which its
// standbys watch: one of them ends the walsender and takes the slot over
// (TestCDCFrozenStreamerIsTakenOver). A relay wrongly taken for dead (its
// pool unable to renew its heartbeat for aliveFor) loses its stream and
// becomes a standby: the stream starts again from the confirmed
// position, and the copies it publishes are dropped by id.
func (r *Relay) endStaleStream(ctx context.Context) bool {
	rows, err := r.pool.Query(ctx, endStaleStreamSQL, r.slot)
	if err != nil {
		r.log.Debug("outbox relay: cannot check the relay that streams the slot", "slot", r.slot, "err", err)
		return false
	}
	ended := false
	for rows.Next() {
		var name string
		var ok bool
		if err := rows.Scan(&name, &ok); err != nil {
			break
		}
		if ok {
			ended = true
			r.log.Warn("outbox relay: the relay streaming the slot stopped saying it is alive; ended its stream to take the slot over",
				"slot", r.slot, "streamer", name)
		}
	}
	if err := rows.Err(); err != nil && !r.cdc.cannotEndLogged.Swap(true) {
		// 42501: the relay's role may not end the walsender (another
		// role's); wal_sender_timeout ends it, in streamTimeout when its
		// relay set it. Said once: standbys ask every PollInterval.
		r.log.Warn("outbox relay: the relay streaming the slot stopped saying it is alive, and its stream cannot be ended from here",
			"slot", r.slot, "err", err)
	}
	return ended
}

// setting reads a server setting for a message: its value, or "?" when
// it cannot be read.
func (r *Relay) setting(ctx context.Context, name string) string {
	var v string
	if err := r.pool.QueryRow(ctx, `SELECT current_setting($1)`, name).Scan(&v); err != nil {
		return "?"
	}
	return v
}

func pgErrCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// prepareSlot checks the database's settings and makes the publication.
func (r *Relay) prepareSlot(ctx context.Context) error {
	var level string
	if err := r.pool.QueryRow(ctx, `SHOW wal_level`).Scan(&level); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if level != "logical" {
		return &unavailableCDCError{fmt.Sprintf("the database runs with wal_level=%s; ModeCDC needs wal_level=logical "+
			"(ALTER SYSTEM SET wal_level = logical, then restart Postgres; scripts/ensure-postgres.sh does it for a local cluster)", level)}
	}
	var exists, member bool
	err := r.pool.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
		       EXISTS (SELECT 1 FROM pg_publication p JOIN pg_publication_rel pr ON pr.prpubid = p.oid
		               WHERE p.pubname = $1 AND pr.prrelid = to_regclass(quote_ident($2) || '.outbox'))`,
		r.slot, r.schema).Scan(&exists, &member)
	if err != nil {
		return fmt.Errorf("read publication %s: %w", r.slot, err)
	}
	table := pgx.Identifier{r.schema, "outbox"}.Sanitize()
	var stmt string
	switch {
	case !exists:
		// Inserts only: the relay's own marks are updates, and the stream
		// need not carry them back.
		stmt = `CREATE PUBLICATION ` + pgx.Identifier{r.slot}.Sanitize() + ` FOR TABLE ` + table + ` WITH (publish = 'insert')`
	case !member: // the schema was made again since
		stmt = `ALTER PUBLICATION ` + pgx.Identifier{r.slot}.Sanitize() + ` ADD TABLE ` + table
	default:
		return nil
	}
	_, err = r.pool.Exec(ctx, stmt)
	switch pgErrCode(err) {
	case "":
		return nil
	case "42710": // duplicate_object: another relay made it first
		return nil
	case "42501": // insufficient_privilege
		return &unavailableCDCError{fmt.Sprintf("the relay's role cannot create publication %s on %s (CREATE PUBLICATION needs CREATE on the database and ownership of the table; or create the publication as the table's owner beforehand): %v", r.slot, table, err)}
	}
	return fmt.Errorf("create publication %s: %w", r.slot, err)
}

// ensureSlot makes the slot when it is missing, or lost: invalidated by
// max_slot_wal_keep_size, or dropped. Events committed before the new slot
// and not yet published are in the table: the poller publishes them, and
// the stream holds back their aggregates' later events until it has.
func (r *Relay) ensureSlot(ctx context.Context, conn *pgconn.PgConn) error {
	var walStatus *string
	var active bool
	err := r.pool.QueryRow(ctx, `SELECT wal_status, active FROM pg_replication_slots WHERE slot_name = $1`, r.slot).Scan(&walStatus, &active)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return fmt.Errorf("read slot %s: %w", r.slot, err)
	case walStatus != nil && *walStatus == "lost":
		if active {
			return &standbyError{errors.New("lost slot still held")}
		}
		r.log.Error("outbox relay: the slot was invalidated (it held more WAL than max_slot_wal_keep_size); "+
			"making it again, and publishing what it had not confirmed from the outbox table", "slot", r.slot)
		if _, err := r.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, r.slot); err != nil {
			if pgErrCode(err) == "55006" {
				return &standbyError{err}
			}
			return fmt.Errorf("drop lost slot %s: %w", r.slot, err)
		}
	default:
		return nil
	}
	_, err = pglogrepl.CreateReplicationSlot(ctx, conn, r.slot, "pgoutput",
		pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "NOEXPORT_SNAPSHOT"})
	switch pgErrCode(err) {
	case "":
	case "42710": // another relay made it first
		return &standbyError{err}
	case "53400": // configuration_limit_exceeded
		return &unavailableCDCError{fmt.Sprintf("no replication slot is free for %s: max_replication_slots=%s, all taken "+
			"(raise it and restart Postgres, or drop slots nothing streams): %v", r.slot, r.setting(ctx, "max_replication_slots"), err)}
	case "42501":
		return &unavailableCDCError{fmt.Sprintf("the relay's role may not replicate (ALTER ROLE ... REPLICATION): %v", err)}
	default:
		return fmt.Errorf("create slot %s: %w", r.slot, err)
	}
	// Failure window: an event committed before the slot (at a first
	// start, say, or while a lost slot was gone) is in no stream. The
	// poller publishes everything due before now at once: waiting the
	// HandOff would hold a fresh shop's first events for seconds. An event
	// committed after now and also streamed goes out twice, same id.
	var made time.Time
	if err := r.pool.QueryRow(ctx, `SELECT now()`).Scan(&made); err != nil {
		return fmt.Errorf("read the database's clock: %w", err)
	}
	r.cdc.backfillBefore.Store(&made)
	r.log.Warn("outbox relay: made the replication slot; events committed before it that are not yet published go out from the outbox table",
		"slot", r.slot)
	r.wake()
	return nil
}

// session is one stream's state shared by its reader and publisher.
type session struct {
	confirmed       atomic.Uint64 // LSN: every event committed at or before it is acked and marked
	pushed, settled atomic.Int64  // transactions handed to the publisher, and settled by it
}

// cdcTx is one committed transaction's outbox events.
type cdcTx struct {
	events []row
	end    pglogrepl.LSN // its end: confirming it confirms the transaction
}

// readStream reads the slot: it decodes committed transactions into txs,
// and reports the confirmed position every statusInterval. It and, once it
// has returned, streamOnce's last word are the only users of conn, in the
// stream's goroutine; the publisher never touches it.
func (r *Relay) readStream(ctx context.Context, conn *pgconn.PgConn, txs chan<- cdcTx, s *session) error {
	relations := map[uint32]*pglogrepl.RelationMessage{}
	types := pgtype.NewMap()
	var (
		cur     *cdcTx        // the transaction being received
		held    *cdcTx        // committed, waiting for room in txs
		walEnd  pglogrepl.LSN // the server's position in its last keepalive: all before it was sent
		nextRep = time.Now()
	)
	for {
		if !time.Now().Before(nextRep) {
			pos := pglogrepl.LSN(s.confirmed.Load())
			if cur == nil && held == nil && s.pushed.Load() == s.settled.Load() {
				// Caught up: nothing received is unsettled, so everything
				// before the server's last keepalive position is done. An
				// outbox with no events follows the WAL others write.
				pos = max(pos, walEnd)
				s.confirmed.Store(uint64(pos))
				r.cdc.caughtUpAt.Store(time.Now().UnixNano())
			}
			err := sendStatus(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pos, ReplyRequested: true})
			if err != nil {
				return fmt.Errorf("send slot status: %w", err)
			}
			nextRep = time.Now().Add(statusInterval)
		}
		if held != nil {
			select {
			case txs <- *held:
				held = nil
				s.pushed.Add(1)
			case <-time.After(time.Until(nextRep)):
			case <-ctx.Done():
				return nil
			}
			continue
		}
		rctx, cancel := context.WithDeadline(ctx, nextRep)
		msg, err := conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("receive from slot: %w", err)
		}
		var data []byte
		switch msg := msg.(type) {
		case *pgproto3.CopyData:
			data = msg.Data
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("slot stream: %w", pgconn.ErrorResponseToPgError(msg))
		default:
			continue
		}
		if len(data) == 0 {
			continue
		}
		switch data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
			if err != nil {
				return fmt.Errorf("parse keepalive: %w", err)
			}
			walEnd = max(walEnd, k.ServerWALEnd)
			if k.ReplyRequested {
				nextRep = time.Time{}
			}
		case pglogrepl.XLogDataByteID:
			x, err := pglogrepl.ParseXLogData(data[1:])
			if err != nil {
				return fmt.Errorf("parse xlog data: %w", err)
			}
			m, err := pglogrepl.Parse(x.WALData)
			if err != nil {
				return fmt.Errorf("parse pgoutput message: %w", err)
			}
			switch m := m.(type) {
			case *pglogrepl.RelationMessage:
				relations[m.RelationID] = m
			case *pglogrepl.BeginMessage:
				cur = &cdcTx{}
			case *pglogrepl.InsertMessage:
				rel := relations[m.RelationID]
				if cur == nil || rel == nil || rel.Namespace != r.schema || rel.RelationName != "outbox" {
					continue
				}
				ev, err := decodeInsert(rel, m.Tuple, types)
				if err != nil {
					return fmt.Errorf("decode outbox insert: %w", err)
				}
				cur.events = append(cur.events, ev)
			case *pglogrepl.CommitMessage:
				if cur != nil && len(cur.events) > 0 {
					cur.end = m.TransactionEndLSN
					for i := range cur.events {
						cur.events[i].since = m.CommitTime
					}
					held = cur
				}
				cur = nil
			}
		}
	}
}

// decodeInsert reads an outbox row from its pgoutput text columns.
func decodeInsert(rel *pglogrepl.RelationMessage, tuple *pglogrepl.TupleData, types *pgtype.Map) (row, error) {
	var ev row
	if tuple == nil || len(tuple.Columns) != len(rel.Columns) {
		return ev, errors.New("tuple does not match its relation")
	}
	for i, c := range rel.Columns {
		col := tuple.Columns[i]
		if col.DataType != pglogrepl.TupleDataTypeText {
			continue // NULLs: last_error, the claim and the marks
		}
		v := col.Data
		var err error
		switch c.Name {
		case "event_id":
			ev.id, err = uuid.ParseBytes(v)
		case "aggregate_type":
			ev.aggType = string(v)
		case "aggregate_id":
			ev.aggID = string(v)
		case "aggregate_seq":
			ev.seq, err = strconv.ParseInt(string(v), 10, 64)
		case "event_type":
			ev.typ = string(v)
		case "schema_version":
			ev.version, err = strconv.Atoi(string(v))
		case "subject":
			ev.subject = string(v)
		case "payload":
			ev.payload = v // json, not jsonb: the writer's bytes as they were
		case "headers":
			err = json.Unmarshal(v, &ev.headers)
		case "occurred_at":
			err = types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, v, &ev.occurred)
		case "attempts":
			ev.attempts, err = strconv.Atoi(string(v))
		}
		if err != nil {
			return ev, fmt.Errorf("column %s: %w", c.Name, err)
		}
	}
	if ev.id == uuid.Nil || ev.subject == "" {
		return ev, errors.New("no event id or subject")
	}
	return ev, nil
}

type aggKey struct{ typ, id string }

// item is one streamed event waiting to be settled.
type item struct {
	ev   row
	tx   *txState
	done bool // acked, or left to the table
}

// txState counts a transaction's unsettled events.
type txState struct {
	end  pglogrepl.LSN
	left int
}

// publishStream publishes the stream's events in batches and settles
// them: acked ones are marked published, then the position of every
// transaction whose events are all settled is confirmed.
func (r *Relay) publishStream(ctx context.Context, txs <-chan cdcTx, s *session) error {
	var (
		queue   []*item
		open    []*txState
		acked   = map[aggKey]int64{} // last seq acked in this stream, per aggregate
		outages = 0
	)
	add := func(tx cdcTx) {
		st := &txState{end: tx.end, left: len(tx.events)}
		open = append(open, st)
		for _, ev := range tx.events {
			queue = append(queue, &item{ev: ev, tx: st})
		}
	}
	for ctx.Err() == nil {
		if len(queue) == 0 {
			select {
			case tx := <-txs:
				add(tx)
			case <-ctx.Done():
				return nil
			}
		}
	more:
		for len(queue) < 4*r.cfg.BatchSize {
			select {
			case tx := <-txs:
				add(tx)
			default:
				break more
			}
		}
		if outages > 0 {
			if err := r.waitForBroker(ctx, outages); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				outages++
				r.brokerDown(err)
				continue
			}
		}
		down, err := r.publishRound(ctx, queue, acked)
		if err != nil {
			return err
		}
		if down != nil {
			outages++
			r.brokerDown(down)
		} else {
			outages = 0
		}
		// Settle: drop what is done, confirm the transactions all done.
		kept := queue[:0]
		for _, it := range queue {
			if it.done {
				it.tx.left--
			} else {
				kept = append(kept, it)
			}
		}
		clear(queue[len(kept):])
		queue = kept
		n := 0
		for n < len(open) && open[n].left == 0 {
			s.confirmed.Store(uint64(open[n].end))
			n++
		}
		if n > 0 {
			open = append(open[:0], open[n:]...)
			s.settled.Add(int64(n))
		}
		if len(acked) > rememberedAcks {
			clear(acked) // every ack in it is marked: the table answers for them now
		}
	}
	// Stopping: the batch in flight was settled; what is queued is
	// unconfirmed, and the next stream sends it again.
	return nil
}

// waitForBroker pauses after an outage, then asks JetStream whether it
// answers.
func (r *Relay) waitForBroker(ctx context.Context, outages int) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(backoff(r.cfg.BackoffBase, r.cfg.OutageBackoffMax, outages, r.jitter)):
	}
	if st := r.nc.Status(); st != nats.CONNECTED {
		return fmt.Errorf("nats connection %s", st)
	}
	return r.probe(ctx)
}

// publishRound publishes one batch from the queue: at most one event per
// aggregate, none behind an unsettled earlier event of its aggregate, each
// only if its aggregate's previous event is acked or published. It sets
// done on the items it settles, and returns the broker's outage, if it
// took nothing, or an error that ends the stream.
func (r *Relay) publishRound(ctx context.Context, queue []*item, acked map[aggKey]int64) (down, err error) {
	var picked []*item
	seen := map[aggKey]bool{}
	for _, it := range queue {
		if len(picked) == r.cfg.BatchSize {
			break
		}
		k := aggKey{it.ev.aggType, it.ev.aggID}
		if it.done || seen[k] {
			continue
		}
		seen[k] = true
		picked = append(picked, it)
	}
	// Which previous events does the stream not know to be acked? The
	// table does.
	var ask []int
	var types, ids []string
	var seqs []int64
	for i, it := range picked {
		k := aggKey{it.ev.aggType, it.ev.aggID}
		if it.ev.seq > 1 && acked[k] < it.ev.seq-1 {
			ask = append(ask, i)
			types, ids, seqs = append(types, k.typ), append(ids, k.id), append(seqs, it.ev.seq-1)
		}
	}
	if len(ask) > 0 {
		rows, err := r.pool.Query(ctx, unpublishedSQL, types, ids, seqs)
		if err != nil {
			return nil, fmt.Errorf("read previous events: %w", err)
		}
		waiting, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return nil, fmt.Errorf("read previous events: %w", err)
		}
		var held [][16]byte
		for _, n := range waiting {
			// Its previous event waits in the table (it failed, or the
			// stream began after it): the poller publishes both, in order.
			it := picked[ask[n-1]]
			it.done = true
			held = append(held, it.ev.id)
			r.cdc.handedOff.Add(1)
		}
		if err := r.handOver(ctx, held); err != nil {
			return nil, err
		}
	}
	batch := make([]row, 0, len(picked))
	var sent []*item
	for _, it := range picked {
		if !it.done {
			batch = append(batch, it.ev)
			sent = append(sent, it)
		}
	}
	if len(batch) == 0 {
		return nil, nil
	}
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout+lookupTimeout)
	defer cancel()
	results, err := r.publish(pctx, batch)
	if err != nil {
		return nil, err // a failpoint: "die", start again from the confirmed position
	}
	var ackedIDs, handed [][16]byte
	commits := map[[16]byte]time.Time{}
	failed := &pgx.Batch{}
	down = verdict(results)
	for i, res := range results {
		it := sent[i]
		switch {
		case res.err == nil:
			it.done = true
			acked[aggKey{it.ev.aggType, it.ev.aggID}] = it.ev.seq
			ackedIDs = append(ackedIDs, it.ev.id)
			commits[it.ev.id] = it.ev.since
			if res.duplicate {
				r.stats.duplicates.Add(1)
			}
			if r.cfg.Hooks.ObservePublishFunc != nil {
				r.cfg.Hooks.ObservePublishFunc(res.latency)
			}
		case res.outage && down != nil:
			// The broker took nothing: not the events' failure. They stay
			// in the queue, the position stays before them, and the
			// stream pauses.
		case res.outage:
			// The broker took the others but not this one (no stream for
			// its subject, an ack lost in a leader change): retrying it in
			// the stream would spin and hold the position for everyone.
			// It is left to the table, uncounted, as the poller hands back
			// an outage's events; its aggregate's later events wait for it.
			it.done = true
			handed = append(handed, it.ev.id)
			r.cdc.handedOff.Add(1)
			r.stats.deferred.Add(1)
		default:
			// Its own failure: recorded in the table, where the poller
			// retries it with backoff (or it is dead); the stream holds
			// back its aggregate's later events until it is published.
			it.done = true
			r.cdc.handedOff.Add(1)
			dead := res.permanent || it.ev.attempts+1 >= r.cfg.MaxAttempts
			delay := backoff(r.cfg.BackoffBase, r.cfg.BackoffMax, it.ev.attempts+1, r.jitter)
			failed.Queue(failCDCSQL, it.ev.id, res.err.Error(), delay.Microseconds(), dead, r.cfg.HandOff.Microseconds())
			if dead {
				r.stats.dead.Add(1)
				r.log.Error("outbox event dead", "event_id", it.ev.id, "event_type", it.ev.typ,
					"aggregate_id", it.ev.aggID, "seq", it.ev.seq, "err", res.err)
			} else {
				r.stats.retried.Add(1)
				r.log.Warn("outbox event publish failed; the table retries it", "event_id", it.ev.id,
					"aggregate_id", it.ev.aggID, "seq", it.ev.seq, "retry_in", delay, "err", res.err)
			}
		}
	}
	if len(ackedIDs) > 0 {
		// Failure window: acked, not marked, not confirmed. A crash here
		// streams them again from the confirmed position, same ids.
		if err := r.cfg.failpoint(failpointAfterAckBeforeMark); err != nil {
			return nil, err
		}
		if err := r.markStreamed(ctx, ackedIDs, commits); err != nil {
			return nil, err
		}
		r.stats.lastPublish.Store(time.Now().UnixNano())
		r.brokerUp()
		// Failure window: marked, not confirmed. A crash here streams them
		// again: copies the duplicate window or the inbox absorbs.
		if err := r.cfg.failpoint(failpointCDCAfterMark); err != nil {
			return nil, err
		}
	}
	if failed.Len() > 0 {
		if err := r.pool.SendBatch(pctx, failed).Close(); err != nil {
			return nil, fmt.Errorf("record %d publish failures: %w", failed.Len(), err)
		}
	}
	if err := r.handOver(pctx, handed); err != nil {
		return nil, err
	}
	return down, nil
}

// markVisibleWait bounds how long the stream waits for the row of an
// event it published to become visible to its mark.
const markVisibleWait = 5 * time.Second

// errMarkUnseen ends a stream whose mark could not see the row of an event
// it published within markVisibleWait.
var errMarkUnseen = errors.New("acked events whose rows the mark cannot see")

// markStreamed marks acked events published, and returns only once every
// row is marked (or was already: a stream that starts again sends events
// its predecessor marked).
//
// Failure window: Postgres sends a transaction's commit to the walsender
// before it makes the transaction visible to other snapshots, so a relay
// that publishes within a millisecond can run its mark while a row is
// still invisible. Such a mark changes no row; confirmed past, the event
// is left to the poller, which publishes it a second time after the
// HandOff (about 1 % of events with no fault at all, before this wait;
// TestCDCMarksEveryEventItPublishes).
// A row the mark cannot see is marked again, after a short pause, until it
// can: its commit was decoded, so it becomes visible. Past markVisibleWait
// the stream ends without confirming it, and the next stream publishes and
// marks it again.
//
// commits holds each event's commit time (the database's clock): a row
// committed longer ago than the Retention may be gone rather than
// invisible (a slot left unconfirmed while the table was published by
// polling), and is not waited for.
func (r *Relay) markStreamed(ctx context.Context, ids [][16]byte, commits map[[16]byte]time.Time) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markVisibleWait+r.cfg.PublishTimeout)
	defer cancel()
	began := time.Now()
	pause := time.Millisecond
	for {
		var marked int64
		var unseen [][16]byte
		if err := r.pool.QueryRow(ctx, markCDCSQL, ids).Scan(&marked, &unseen); err != nil {
			return fmt.Errorf("mark %d events published: %w", len(ids), err)
		}
		r.stats.published.Add(marked)
		unseen = slices.DeleteFunc(unseen, func(id [16]byte) bool {
			return time.Since(commits[id]) > r.cfg.Retention
		})
		if len(unseen) == 0 {
			return nil
		}
		if pause == time.Millisecond { // the first try
			r.cdc.markWaits.Add(int64(len(unseen)))
		}
		if time.Since(began) > markVisibleWait {
			return fmt.Errorf("%w: %d events, the first %s, not visible after %v",
				errMarkUnseen, len(unseen), uuid.UUID(unseen[0]), markVisibleWait)
		}
		ids = unseen
		select {
		case <-ctx.Done():
			return fmt.Errorf("mark %d events published: %w", len(ids), ctx.Err())
		case <-time.After(pause):
		}
		pause = min(2*pause, 100*time.Millisecond)
	}
}

// handOver makes events the stream left to the table due for the poller
// at once. The HandOff keeps the poller off events the stream may still
// publish; these it will not, and an aggregate whose earlier event was
// backfilled would otherwise wait the HandOff for each later one.
func (r *Relay) handOver(ctx context.Context, ids [][16]byte) error {
	if len(ids) == 0 {
		return nil
	}
	if _, err := r.pool.Exec(ctx, handOverSQL, ids, r.cfg.HandOff.Microseconds()); err != nil {
		return fmt.Errorf("hand %d events to the table: %w", len(ids), err)
	}
	r.wake()
	return nil
}

// handOverSQL backdates available_at by the HandOff: due for the poller
// now (the poller's claim subtracts the HandOff in ModeCDC).
const handOverSQL = `
UPDATE outbox SET available_at = LEAST(available_at, now() - $2 * interval '1 microsecond')
WHERE event_id = ANY($1) AND published_at IS NULL`

// unpublishedSQL returns the positions (1-based) of the given events that
// are in the table and not published (pending or dead).
const unpublishedSQL = `
SELECT p.n FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS p(t, i, s, n)
JOIN outbox o ON o.aggregate_type = p.t AND o.aggregate_id = p.i AND o.aggregate_seq = p.s
WHERE o.published_at IS NULL`

// markCDCSQL marks streamed events published, and returns how many rows it
// changed and the events whose rows its snapshot does not hold (committed,
// not yet visible; markStreamed). The update and the check share the
// statement's snapshot, so a row is either marked, already published, or
// unseen. No claim fences the mark: only one relay streams a slot, and an
// acked event is published whoever says so. The poller's claim on the row,
// if any, stays for its own mark.
const markCDCSQL = `
WITH marked AS (
	UPDATE outbox SET published_at = now()
	WHERE event_id = ANY($1::uuid[]) AND published_at IS NULL
	RETURNING 1
)
SELECT (SELECT count(*) FROM marked),
       ARRAY(SELECT id FROM unnest($1::uuid[]) AS id
             WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = id))`

// failCDCSQL records a streamed event's own failure; the poller retries it
// after the delay (backdated by the HandOff, as handOverSQL), or it is
// dead. The parameters' types are spelled out: "$3 - $5" alone is
// "operator is not unique: unknown - unknown", and every event that failed
// on its own ended the stream, over and over (each time publishing the
// unconfirmed tail again), until the poller took the event after the
// HandOff (TestThePublishIsASpanBetweenTheWriterAndTheConsumers/cdc,
// TestTransientFailuresBackOffThenDie/cdc).
const failCDCSQL = `
UPDATE outbox
SET attempts = attempts + 1,
    last_error = $2,
    available_at = now() + ($3::bigint - $5::bigint) * interval '1 microsecond',
    dead_at = CASE WHEN $4 THEN now() END
WHERE event_id = $1 AND published_at IS NULL AND dead_at IS NULL`
