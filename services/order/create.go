package order

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/saga"
)

var (
	// errInFlight says when to retry: the twin's transaction is a few
	// round trips long, so a second is plenty.
	errInFlight    = httpx.NewProblem(http.StatusConflict, "request-in-flight", "a request with this Idempotency-Key is still being processed: wait Retry-After seconds for it to finish, then send this request again with the same key to get its answer").WithRetryAfter(time.Second)
	errKeyReused   = httpx.NewProblem(http.StatusUnprocessableEntity, "idempotency-key-reused", "this Idempotency-Key was used with a different request")
	errOrderTooBig = httpx.Invalid("the order total is too large")
)

// reply is the response of POST /orders: a new order, or the response
// stored with its key.
type reply struct {
	status   int
	body     []byte
	replayed bool
}

// create runs the transaction of POST /orders and returns the response to
// send. Read createPlain (create_plain_test.go) first: the same
// transaction as the textbook writes it, a statement at a time with
// pgx.BeginFunc, saga.Start and outbox.Add, held to the same answers and
// rows by TestPlainAndPipelinedCreateAgree. This form pipelines those
// statements: a new order costs two round trips, BEGIN with the reads,
// then the writes with COMMIT (a refusal or a replay: the reads, then
// ROLLBACK), which POST /orders' throughput depends on (docs/performance.md).
func (s *Service) create(ctx context.Context, key string, req createRequest) (reply, error) {
	hash := req.hash()
	// A connection of its own rather than a pgx.Tx: the transaction ends
	// with the COMMIT that rides in the last batch, which a pgx.Tx cannot
	// know about.
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return reply{}, fmt.Errorf("create order: %w", err)
	}
	defer func() {
		// A refusal, a replay or a failed write leaves the transaction
		// open (or aborted): nothing of it is kept. Should the ROLLBACK
		// fail, Release closes the connection instead of pooling it.
		if conn.Conn().PgConn().TxStatus() != 'I' {
			_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		}
		conn.Release()
	}()

	// The reads, in one round trip with BEGIN. Postgres runs them in order,
	// each on a fresh snapshot, so the key is looked up only once its lock
	// is held, and sees the key row of a twin that committed before that.
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	// A transaction-scoped lock on the key: a twin in flight gets 409 at
	// once instead of waiting, and the lock is released by the commit that
	// makes the key row visible to the next one.
	var locked bool
	b.Queue(keyLockSQL, key).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(&locked); err != nil {
			return fmt.Errorf("lock idempotency key: %w", err)
		}
		return nil
	})
	stored := queueLookupKey(b, key)
	known := queuePrices(b, req.skus())
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return reply{}, fmt.Errorf("create order: %w", err)
	}
	if !locked {
		// A twin holds the key. The lookup ran all the same, without the
		// lock, so its answer may be stale: it is not used.
		return reply{}, errInFlight
	}
	if stored.found && !stored.expired {
		if string(stored.hash) != string(hash) {
			return reply{}, errKeyReused
		}
		// The stored response, not the order's state now: a retry sees
		// exactly what the first attempt would have seen.
		return reply{status: stored.status, body: stored.response, replayed: true}, nil
	}
	o, err := newOrder(req, known)
	if err != nil {
		return reply{}, err
	}
	// The response is the order as built here, so it can be stored with
	// the key in the same batch as everything else.
	res := reply{status: http.StatusCreated}
	if res.body, err = json.Marshal(o); err != nil {
		return reply{}, fmt.Errorf("encode order: %w", err)
	}

	// The writes and COMMIT, in one round trip: order, history, saga and
	// its reservation timeout, OrderCreated and the key commit together,
	// or (any of them failing) not at all. Postgres skips what follows a
	// failed statement up to the batch's end, COMMIT included, so a failed
	// write leaves an aborted transaction that the deferred ROLLBACK ends.
	b = &pgx.Batch{}
	queueInsertOrder(b, o)
	// The reservation deadline is armed with the order: if inventory never
	// answers, the saga closes it instead of leaving it PENDING for ever.
	reserveBy := saga.Timeout{Name: reservationTimeout, Due: o.CreatedAt.Add(s.cfg.ReservationTimeout)}
	if err := s.saga.QueueStart(ctx, b, o.ID.String(), Pending, nil, reserveBy); err != nil {
		return reply{}, err
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("shop.order_id", o.ID.String()))
	if err := s.outbox.Queue(ctx, b, orderCreated(o)); err != nil {
		return reply{}, err
	}
	if stored.expired {
		// An expired record counts as absent: it makes way for this one,
		// so the key can be used afresh.
		queueDeleteKey(b, key)
	}
	queueInsertKey(b, key, hash, res.status, res.body, o.ID, s.cfg.KeyTTL)
	b.Queue("COMMIT").Exec(func(tag pgconn.CommandTag) error {
		// COMMIT of an aborted transaction answers ROLLBACK, not an
		// error; nothing before it failed, so this should not happen,
		// and if it does the order does not exist.
		if tag.String() != "COMMIT" {
			return pgx.ErrTxCommitRollback
		}
		return nil
	})
	// Failure window: the connection is lost after COMMIT was sent. Whether
	// it took effect is unknown; the error is transient (503), and the
	// client's retry with the same key finds the order or creates it.
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return reply{}, fmt.Errorf("create order %s: %w", o.ID, err)
	}
	// Debug: the order is on record anyway (its row, its OrderCreated,
	// `shop trace`); failures are logged where they are handled.
	s.log.Debug("order created", "order_id", o.ID)
	return res, nil
}

// replay answers a request from its key's stored response without a
// transaction: it returns the stored reply (replayed), errKeyReused when
// the key was used with another request, and a zero reply when the key
// has no live record. It is what POST /orders can still do while it sheds.
// A lookup that fails counts as no record: the request is shed (503 with
// Retry-After), the answer it would have had anyway.
func (s *Service) replay(ctx context.Context, key string, hash []byte) (reply, error) {
	stored, err := lookupKey(ctx, s.pool, key)
	switch {
	case err != nil:
		s.log.Warn("idempotency key not looked up while shedding; shedding the request", "err", err)
		return reply{}, nil
	case !stored.found || stored.expired:
		return reply{}, nil
	case string(stored.hash) != string(hash):
		return reply{}, errKeyReused
	}
	return reply{status: stored.status, body: stored.response, replayed: true}, nil
}

// newOrder builds the new order from the request and the catalogue prices
// known. Unknown SKUs and totals beyond int64 are 422.
func newOrder(req createRequest, known map[string]int64) (Order, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return Order{}, fmt.Errorf("new order id: %w", err)
	}
	at := now()
	o := Order{ID: id, CustomerID: req.CustomerID, Status: Pending, CreatedAt: at, UpdatedAt: at,
		History: []Entry{{Status: Pending, At: at}}}
	for i, it := range req.Items {
		price, ok := known[it.SKU]
		if !ok {
			return Order{}, httpx.Invalid("items[%d].sku %q is not in the catalogue", i, it.SKU)
		}
		q := int64(it.Quantity)
		if price > 0 && q > math.MaxInt64/price || o.Total > math.MaxInt64-price*q {
			return Order{}, errOrderTooBig
		}
		o.Total += price * q
		o.Items = append(o.Items, Item{SKU: it.SKU, Quantity: it.Quantity, UnitPrice: price})
	}
	return o, nil
}

// orderCreatedPayload is OrderCreated's payload. A struct rather than a
// map: no map to build, sort and walk per order. Its fields are in the
// order the map's keys were encoded (sorted), so the bytes are the same.
type orderCreatedPayload struct {
	CreatedAt  time.Time     `json:"created_at"`
	CustomerID string        `json:"customer_id"`
	Items      []createdLine `json:"items"`
	OrderID    uuid.UUID     `json:"order_id"`
	Total      int64         `json:"total"`
}

// createdLine is a line of OrderCreated: the event's own type, so that
// the API's Item can change without changing the event.
type createdLine struct {
	SKU       string `json:"sku"`
	Quantity  int    `json:"quantity"`
	UnitPrice int64  `json:"unit_price"`
}

func orderCreated(o Order) outbox.Event {
	lines := make([]createdLine, len(o.Items))
	for i, it := range o.Items {
		lines[i] = createdLine(it)
	}
	return event(o.ID, "OrderCreated", orderCreatedPayload{
		CreatedAt:  o.CreatedAt,
		CustomerID: o.CustomerID,
		Items:      lines,
		OrderID:    o.ID,
		Total:      o.Total,
	})
}

// keyLockSQL takes the transaction-scoped advisory lock of an
// Idempotency-Key. Advisory locks belong to the whole database, so the key
// is hashed with the schema: two shops (or a test's schemas) in one
// database would otherwise answer 409 to each other's customers who
// happen to use the same key.
const keyLockSQL = `SELECT pg_try_advisory_xact_lock(` + keyLockID + `)`

// keyLockID is the advisory lock id of the key $1 in the current schema.
const keyLockID = `hashtextextended(current_schema() || '/' || $1, 0)`
