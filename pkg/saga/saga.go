package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Event is what drives a transition: a consumed message, a fired timeout
// ("timeout:<name>") or a command such as a customer cancel.
type Event struct {
	Type string          // e.g. "InventoryReserved"
	ID   string          // the event id, recorded with unexpected events; may be empty
	Data json.RawMessage // the payload, for the transition's func
}

// TimeoutEvent is the event type a fired timeout called name applies.
func TimeoutEvent(name string) string { return "timeout:" + name }

// Instance is a persisted saga instance.
type Instance struct {
	ID        string
	Type      string
	State     string
	Version   int64 // 1 at Start, +1 per transition
	Data      json.RawMessage
	UpdatedAt time.Time
}

// Step is one transition in progress, handed to its TransitionFunc. The func
// may replace Data, set or cancel timeouts, and queue its own writes on
// [Step.Batch]; all of them are sent, with the new state, in one round trip
// after it returns.
type Step struct {
	Instance Instance // as it was before the transition (Data is the old data)
	Event    Event
	To       string          // the state the instance moves to
	Data     json.RawMessage // the data stored after the step; starts as Instance.Data

	batch  *pgx.Batch
	set    map[string]time.Time
	cancel map[string]bool
}

// Batch is the batch that Apply sends on the transition's transaction after
// the func returns: first the writes the func queued on it (business rows,
// outbox events through outbox.Writer.Queue), then the new state and
// timeouts. Queued writes cost no round trip of their own and commit or
// roll back with the transition. Apply sends it; the func must not. The
// func's reads through tx run before it, so they do not see its writes; a
// queued write that fails is returned by Apply, and the caller rolls back.
func (s *Step) Batch() *pgx.Batch { return s.batch }

// SetTimeout makes the timeout called name fire at due, replacing any timeout
// of that name. It is written in the transition's transaction.
func (s *Step) SetTimeout(name string, due time.Time) {
	delete(s.cancel, name)
	s.set[name] = due
}

// CancelTimeout removes the timeout called name, if any.
func (s *Step) CancelTimeout(name string) {
	delete(s.set, name)
	s.cancel[name] = true
}

// TransitionFunc does the work of a transition inside tx: business rows,
// outbox events, timeouts on st. Writes are best queued on st.Batch(); tx is
// there for the reads the func needs, and for writes whose results it does.
// An error rolls the whole transition back (the caller's tx must then be
// rolled back).
type TransitionFunc func(ctx context.Context, tx pgx.Tx, st *Step) error

// Transition moves an instance in state From that receives an event of type
// Event to state To (which may equal From), running Func (nil: nothing).
type Transition struct {
	From, Event, To string
	Func            TransitionFunc
}

// Result tells what Apply did.
type Result struct {
	Applied  bool   // false: the event was unexpected, recorded and ignored
	From, To string // From is "" when there is no such instance
	Version  int64  // the instance's version after Apply
}

// Saga is one saga type with its transitions. It is safe for concurrent use.
type Saga struct {
	typ   string
	table map[[2]string]Transition
}

// ErrExists is returned by Start when an instance with the id exists.
var ErrExists = errors.New("saga: instance exists")

// ErrNotFound is returned by Load for an unknown instance.
var ErrNotFound = errors.New("saga: instance not found")

// New declares the saga type typ. A (From, Event) pair may appear only once.
func New(typ string, transitions ...Transition) (*Saga, error) {
	if typ == "" {
		return nil, errors.New("saga: New needs a type")
	}
	s := &Saga{typ: typ, table: map[[2]string]Transition{}}
	for _, t := range transitions {
		if t.From == "" || t.Event == "" || t.To == "" {
			return nil, fmt.Errorf("saga %s: transition %+v needs From, Event and To", typ, t)
		}
		k := [2]string{t.From, t.Event}
		if _, dup := s.table[k]; dup {
			return nil, fmt.Errorf("saga %s: two transitions from %s on %s", typ, t.From, t.Event)
		}
		s.table[k] = t
	}
	return s, nil
}

// Timeout is a durable timeout armed when an instance starts, for a first
// state that must not last for ever: it fires as TimeoutEvent(Name) at Due
// unless a transition cancels it first ([Step.CancelTimeout]).
type Timeout struct {
	Name string
	Due  time.Time
}

// Start creates instance id in state inside tx, the caller's transaction, so
// the saga exists exactly when the business row that starts it does, and
// with it its timeouts. data is stored as JSON (nil: {}). An instance with
// the id that exists already is ErrExists.
func (s *Saga) Start(ctx context.Context, tx pgx.Tx, id, state string, data any, timeouts ...Timeout) error {
	b := &pgx.Batch{}
	if err := s.QueueStart(ctx, b, id, state, data, timeouts...); err != nil {
		return err
	}
	return tx.SendBatch(ctx, b).Close()
}

// QueueStart queues the inserts of [Saga.Start] into b, for a caller that
// sends the business rows starting the saga as one batch: the instance and
// its timeouts then cost no round trip of their own. Start's guarantee
// holds only if b is sent on the transaction that holds those rows.
//
// The timeouts keep the trace context of ctx: the transition they fire
// continues its trace.
//
// QueueStart fails only when data does not encode or a timeout has no name;
// then it has queued nothing. The insert's errors surface from the batch's
// Close, wrapping ErrExists when the id is taken; the caller rolls the
// transaction back.
func (s *Saga) QueueStart(ctx context.Context, b *pgx.Batch, id, state string, data any, timeouts ...Timeout) error {
	raw := []byte("{}")
	if data != nil {
		var err error
		if raw, err = json.Marshal(data); err != nil {
			return fmt.Errorf("saga %s: encode data: %w", s.typ, err)
		}
	}
	for _, t := range timeouts {
		if t.Name == "" {
			return fmt.Errorf("saga %s %s: a start timeout needs a name", s.typ, id)
		}
	}
	q := b.Queue(`INSERT INTO saga_instances (id, type, state, data) VALUES ($1, $2, $3, $4)`, id, s.typ, state, raw)
	// Not q.Exec: its callback sees only successes, and a taken id must
	// become ErrExists.
	q.Fn = func(br pgx.BatchResults) error {
		_, err := br.Exec()
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" {
			return fmt.Errorf("saga %s %s: %w", s.typ, id, ErrExists)
		}
		if err != nil {
			return fmt.Errorf("saga %s %s: start: %w", s.typ, id, err)
		}
		return nil
	}
	// After the instance: the timeouts reference it.
	trace := traceHeaders(ctx)
	for _, t := range timeouts {
		b.Queue(`INSERT INTO saga_timeouts (saga_id, name, due_at, trace_headers) VALUES ($1, $2, $3, $4)`, id, t.Name, t.Due, trace)
	}
	return nil
}

// Apply runs the transition of instance id for ev inside tx, the caller's
// transaction (for a consumed event: the inbox transaction, so the new state,
// the func's outbox events and timeouts, and the processed_events row commit
// together). It locks the instance row, so events of one instance take turns.
// It is [Saga.ApplyBatch] with one event.
//
// An event with no transition from the current state, or for an instance
// that does not exist, is recorded in saga_unexpected and ignored: Apply
// returns a Result with Applied false and a nil error, so a consumer acks it
// instead of retrying something that can never succeed. Errors are
// database failures and errors of the func; the caller rolls tx back.
//
// A transition costs two round trips plus the func's own reads: the lock,
// then one batch with the func's queued writes, the new state and timeouts.
func (s *Saga) Apply(ctx context.Context, tx pgx.Tx, id string, ev Event) (Result, error) {
	res, err := s.ApplyBatch(ctx, tx, []BatchEvent{{Ctx: ctx, ID: id, Event: ev}})
	if err != nil {
		return Result{}, err
	}
	return res[0], nil
}

// prepared is a transition run but not yet saved: batch holds the func's
// writes, then the new state and timeouts (or, for an unexpected event,
// its record), to be sent on the transition's transaction.
type prepared struct {
	res   Result
	data  json.RawMessage // the instance's data after the transition
	batch *pgx.Batch
	span  trace.Span // nil for an unexpected event
}

// end ends the transition's span, once what was prepared is saved (err nil)
// or not.
func (p prepared) end(err error) {
	if p.span != nil {
		endTransition(p.span, err)
	}
}

// prepare runs the transition of in for ev in tx (the func and its reads)
// and queues what saves it; nothing is written until the batch is sent.
func (s *Saga) prepare(ctx context.Context, tx pgx.Tx, in Instance, ev Event) (prepared, error) {
	b := &pgx.Batch{}
	t, ok := s.table[[2]string{in.State, ev.Type}]
	if !ok {
		trace.SpanFromContext(ctx).AddEvent("saga unexpected event", trace.WithAttributes(
			attribute.String("saga.type", s.typ), attribute.String("saga.id", in.ID),
			attribute.String("saga.state", in.State), attribute.String("saga.event", ev.Type)))
		s.queueUnexpected(b, in.ID, &in.State, ev)
		return prepared{res: Result{From: in.State, To: in.State, Version: in.Version}, data: in.Data, batch: b}, nil
	}
	ctx, span := startTransition(ctx, s.typ, in, t)
	st := &Step{Instance: in, Event: ev, To: t.To, Data: in.Data,
		batch: b, set: map[string]time.Time{}, cancel: map[string]bool{}}
	if t.Func != nil {
		if err := t.Func(ctx, tx, st); err != nil {
			return prepared{span: span}, fmt.Errorf("saga %s %s: %s on %s: %w", s.typ, in.ID, in.State, ev.Type, err)
		}
	}
	// The func's writes first, in the order it queued them, then the state:
	// one round trip for the whole transition.
	b.Queue(`UPDATE saga_instances SET state = $2, version = version + 1, data = $3, updated_at = now() WHERE id = $1`,
		in.ID, t.To, []byte(st.Data))
	trace := traceHeaders(ctx) // the transition's span: the timeout continues it
	for name, due := range st.set {
		b.Queue(`INSERT INTO saga_timeouts (saga_id, name, due_at, trace_headers) VALUES ($1, $2, $3, $4)
			ON CONFLICT (saga_id, name) DO UPDATE SET due_at = EXCLUDED.due_at, trace_headers = EXCLUDED.trace_headers`, in.ID, name, due, trace)
	}
	for name := range st.cancel {
		b.Queue(`DELETE FROM saga_timeouts WHERE saga_id = $1 AND name = $2`, in.ID, name)
	}
	return prepared{
		res:  Result{Applied: true, From: in.State, To: t.To, Version: in.Version + 1},
		data: st.Data, batch: b, span: span,
	}, nil
}

// queueUnexpected queues the record of an event with no transition (state
// nil: no such instance).
func (s *Saga) queueUnexpected(b *pgx.Batch, id string, state *string, ev Event) {
	b.Queue(`INSERT INTO saga_unexpected (saga_id, saga_type, state, event_type, event_id)
		VALUES ($1, $2, $3, $4, NULLIF($5, ''))`, id, s.typ, state, ev.Type, ev.ID)
}

// DB is a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type DB interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Load reads instance id without locking it.
func Load(ctx context.Context, db DB, id string) (Instance, error) {
	return scan(db.QueryRow(ctx, `SELECT `+instanceColumns+` FROM saga_instances WHERE id = $1`, id), id)
}

// instanceColumns are what scan reads, in its order.
const instanceColumns = `id, type, state, version, data, updated_at`

func scan(row pgx.Row, id string) (Instance, error) {
	var in Instance
	err := row.Scan(&in.ID, &in.Type, &in.State, &in.Version, &in.Data, &in.UpdatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return in, fmt.Errorf("saga instance %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return in, fmt.Errorf("saga instance %s: %w", id, err)
	}
	return in, nil
}
