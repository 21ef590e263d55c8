package order

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"strings"
	"time"
	"unicode"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/outbox"
	"github.com/shop-ref/shop/pkg/saga"
)

// Routes mounts the order API on r.
func (s *Service) Routes(r chi.Router) {
	r.Post("/orders", s.createOrder)
	r.Get("/orders/{id}", s.getOrder)
	r.Post("/orders/{id}/cancel", s.cancelOrder)
}

// Limits of a new order, from the contract.
const (
	maxKeyLen      = 255
	maxCustomerLen = 64
	maxLines       = 100
	maxQuantity    = 1000
)

var skuPattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// createRequest is the body of POST /orders.
type createRequest struct {
	CustomerID string `json:"customer_id"`
	Items      []struct {
		SKU      string `json:"sku"`
		Quantity int    `json:"quantity"`
	} `json:"items"`
}

// createOrder handles POST /orders. Everything that can refuse the request
// without the database (key, body, syntax) is checked first; then one
// transaction takes the key's advisory lock, settles replays, prices the
// order and writes order, history, saga, key and OrderCreated together, so a
// refused request writes nothing and an accepted one writes everything.
func (s *Service) createOrder(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if err := checkKey(key); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	var req createRequest
	if _, err := httpx.Decode(r, &req); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	if err := req.validate(); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	var res reply
	var err error
	if busy, shed := s.admission.shed(); shed {
		// Shed while the saga lags, but only new work: a retry of an order
		// that committed (its answer was lost) gets its stored response,
		// or the client would see 503 for as long as shedding lasts about
		// an order it has. One key lookup, no lock, no write; a new key
		// is refused before anything is written.
		if res, err = s.replay(r.Context(), key, req.hash()); err == nil && !res.replayed {
			writeOverloaded(w, r, s.log, busy)
			return
		}
	} else {
		res, err = s.create(r.Context(), key, req)
	}
	if err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	// Failure window: the order (or the replay's read) is committed, the
	// client has no answer. It retries with the same Idempotency-Key and
	// gets the stored response: the same order, not a second one. An
	// injected error drops the connection without a response, as a crash
	// would.
	if err := s.hooks.Failpoint(failpoint.OrderAfterCommitBeforeResponse); err != nil {
		s.log.Warn("order failpoint: dropping the response", "err", err)
		panic(http.ErrAbortHandler)
	}
	w.Header().Set("Content-Type", "application/json")
	if res.replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.WriteHeader(res.status)
	_, _ = w.Write(res.body)
}

// checkKey accepts 1..255 printable ASCII characters: keys are compared
// byte for byte, and anything else is more likely a client bug than a key.
func checkKey(key string) error {
	if key == "" || len(key) > maxKeyLen {
		return httpx.NewProblem(http.StatusBadRequest, "idempotency-key",
			fmt.Sprintf("the Idempotency-Key header is required: 1 to %d printable ASCII characters", maxKeyLen))
	}
	for i := range len(key) {
		if key[i] < 0x20 || key[i] > 0x7e {
			return httpx.NewProblem(http.StatusBadRequest, "idempotency-key",
				"the Idempotency-Key header may hold printable ASCII characters only")
		}
	}
	return nil
}

// validate checks what needs no database. A SKU listed twice is refused
// (422) rather than merged: the client most likely made a mistake, and
// merging would make the stored lines differ from the request.
func (req *createRequest) validate() error {
	switch {
	case req.CustomerID == "" || len(req.CustomerID) > maxCustomerLen:
		return httpx.Invalid("customer_id must be 1 to %d characters", maxCustomerLen)
	case strings.ContainsFunc(req.CustomerID, func(r rune) bool { return !unicode.IsPrint(r) }):
		// Control characters (NUL above all, which Postgres text cannot
		// hold) are no one's customer id; found by FuzzOrderRequest.
		return httpx.Invalid("customer_id may hold printable characters only")
	case len(req.Items) == 0 || len(req.Items) > maxLines:
		return httpx.Invalid("an order needs 1 to %d lines, not %d", maxLines, len(req.Items))
	}
	seen := map[string]bool{}
	for i, it := range req.Items {
		switch {
		case !skuPattern.MatchString(it.SKU):
			return httpx.Invalid("items[%d].sku %q must match [A-Za-z0-9_-]{1,64}", i, it.SKU)
		case it.Quantity < 1 || it.Quantity > maxQuantity:
			return httpx.Invalid("items[%d].quantity must be 1 to %d, not %d", i, maxQuantity, it.Quantity)
		case seen[it.SKU]:
			return httpx.Invalid("items[%d]: sku %q is listed twice; put it on one line", i, it.SKU)
		}
		seen[it.SKU] = true
	}
	return nil
}

// hash is the request's fingerprint for the idempotency check: SHA-256 of
// the decoded request encoded again as JSON, so whitespace, field order and
// escapes in the raw body do not matter, but every value does.
func (req *createRequest) hash() []byte {
	b, _ := json.Marshal(req) // a struct of strings and ints cannot fail
	h := sha256.Sum256(b)
	return h[:]
}

var (
	// errInFlight says when to retry: the twin's transaction is a few
	// round trips long, so a second is plenty.
	errInFlight    = httpx.NewProblem(http.StatusConflict, "request-in-flight", "a request with this Idempotency-Key is still being processed; retry shortly").WithRetryAfter(time.Second)
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
// send. It costs three round trips: BEGIN with the reads, the writes in one
// batch, COMMIT.
func (s *Service) create(ctx context.Context, key string, req createRequest) (reply, error) {
	hash := req.hash()
	// The reads, in one round trip with BEGIN. Postgres runs them in order,
	// each on a fresh snapshot, so the key is looked up only once its lock
	// is held, and sees the key row of a twin that committed before that.
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{}) // BEGIN rides in the batch: one round trip fewer
	// A transaction-scoped lock on the key: a twin in flight gets 409 at
	// once instead of waiting, and the lock is released by the commit that
	// makes the key row visible to the next one.
	var locked bool
	b.Queue(`SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))`, key).QueryRow(func(row pgx.Row) error {
		if err := row.Scan(&locked); err != nil {
			return fmt.Errorf("lock idempotency key: %w", err)
		}
		return nil
	})
	stored := queueLookupKey(b, key)
	known := queuePrices(b, req.skus())
	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if err := br.Close(); err != nil {
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

	// The writes, in one round trip: order, history, saga and its
	// reservation timeout, OrderCreated and the key commit together, or
	// (any of them failing) not at all.
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
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return reply{}, fmt.Errorf("create order %s: %w", o.ID, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return reply{}, fmt.Errorf("create order %s: commit: %w", o.ID, err)
	}
	s.log.Info("order created", "order_id", o.ID)
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

// skus lists the request's SKUs, in request order.
func (req *createRequest) skus() []string {
	skus := make([]string, len(req.Items))
	for i, it := range req.Items {
		skus[i] = it.SKU
	}
	return skus
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

func orderCreated(o Order) outbox.Event {
	type line struct {
		SKU       string `json:"sku"`
		Quantity  int    `json:"quantity"`
		UnitPrice int64  `json:"unit_price"`
	}
	lines := make([]line, len(o.Items))
	for i, it := range o.Items {
		lines[i] = line(it)
	}
	return event(o.ID, "OrderCreated", map[string]any{
		"order_id":    o.ID,
		"customer_id": o.CustomerID,
		"items":       lines,
		"total":       o.Total,
		"created_at":  o.CreatedAt,
	})
}

// getOrder handles GET /orders/{id}.
func (s *Service) getOrder(w http.ResponseWriter, r *http.Request) {
	id, err := orderID(r)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	o, err := getOrder(r.Context(), s.pool, id)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, problem(err))
		return
	}
	httpx.WriteJSON(w, http.StatusOK, o)
}

var errNotCancellable = httpx.NewProblem(http.StatusConflict, "not-cancellable", "only a PENDING or WAIT_PAY order can be cancelled")

// cancelOrder handles POST /orders/{id}/cancel: the customer's cancel is a
// saga event like any other, applied under the instance's row lock, so it
// cannot interleave with a reservation or a payment of the same order.
func (s *Service) cancelOrder(w http.ResponseWriter, r *http.Request) {
	id, err := orderID(r)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	ctx := r.Context()
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		res, err := s.saga.Apply(ctx, tx, id.String(), saga.Event{Type: evCancel})
		switch {
		case err != nil:
			return err
		case res.From == "":
			return ErrNotFound
		case !res.Applied:
			// Roll back: a refused cancel writes nothing, not even the
			// saga's record of an unexpected event.
			return errNotCancellable
		}
		return nil
	})
	if err != nil {
		httpx.WriteProblem(w, r, s.log, problem(err))
		return
	}
	o, err := getOrder(ctx, s.pool, id)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, problem(err))
		return
	}
	httpx.WriteJSON(w, http.StatusAccepted, o)
}

func orderID(r *http.Request) (uuid.UUID, error) {
	id, err := uuid.Parse(chi.URLParam(r, "id"))
	if err != nil {
		return uuid.Nil, problem(ErrNotFound)
	}
	return id, nil
}

// problem maps the service's errors to HTTP problems; the rest become 500s.
func problem(err error) error {
	if errors.Is(err, ErrNotFound) {
		return httpx.NewProblem(http.StatusNotFound, "order-not-found", "no order has this id")
	}
	return err
}
