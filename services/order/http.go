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
	"unicode"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

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
	status, body, replayed, err := s.create(r.Context(), key, req)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	// Failure window: the order (or the replay's read) is committed, the
	// client has no answer. It retries with the same Idempotency-Key and
	// gets the stored response: the same order, not a second one. An
	// injected error drops the connection without a response, as a crash
	// would.
	if err := s.cfg.failpoint(failpoint.OrderAfterCommitBeforeResponse); err != nil {
		s.log.Warn("order failpoint: dropping the response", "err", err)
		panic(http.ErrAbortHandler)
	}
	w.Header().Set("Content-Type", "application/json")
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
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
	errInFlight    = httpx.NewProblem(http.StatusConflict, "request-in-flight", "a request with this Idempotency-Key is still being processed; retry shortly")
	errKeyReused   = httpx.NewProblem(http.StatusUnprocessableEntity, "idempotency-key-reused", "this Idempotency-Key was used with a different request")
	errOrderTooBig = httpx.Invalid("the order total is too large")
)

// create runs the transaction of POST /orders and returns the response to
// send: the new order, or the stored response of a replay.
func (s *Service) create(ctx context.Context, key string, req createRequest) (status int, body []byte, replayed bool, err error) {
	hash := req.hash()
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// A transaction-scoped lock on the key: a twin in flight gets 409
		// at once instead of waiting, and the lock is released by the
		// commit that makes the key row visible to the next one.
		var locked bool
		if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))`, key).Scan(&locked); err != nil {
			return fmt.Errorf("lock idempotency key: %w", err)
		}
		if !locked {
			return errInFlight
		}
		stored, err := lookupKey(ctx, tx, key)
		if err != nil {
			return err
		}
		if stored != nil {
			if string(stored.hash) != string(hash) {
				return errKeyReused
			}
			// The stored response, not the order's state now: a retry
			// sees exactly what the first attempt would have seen.
			status, body, replayed = stored.status, stored.response, true
			return nil
		}
		o, err := s.price(ctx, tx, req)
		if err != nil {
			return err
		}
		if err := insertOrder(ctx, tx, o); err != nil {
			return err
		}
		if err := s.saga.Start(ctx, tx, o.ID.String(), Pending, nil); err != nil {
			return err
		}
		if err := s.outbox.Add(ctx, tx, orderCreated(o)); err != nil {
			return err
		}
		status = http.StatusCreated
		if body, err = json.Marshal(o); err != nil {
			return fmt.Errorf("encode order: %w", err)
		}
		return insertKey(ctx, tx, key, hash, status, body, o.ID, s.cfg.KeyTTL)
	})
	if err != nil {
		return 0, nil, false, err
	}
	if !replayed {
		s.log.Info("order created", "order_id", jsonField(body, "order_id"))
	}
	return status, body, replayed, nil
}

// price builds the new order from the request and the catalogue. Unknown
// SKUs and totals beyond int64 are 422.
func (s *Service) price(ctx context.Context, tx pgx.Tx, req createRequest) (Order, error) {
	skus := make([]string, len(req.Items))
	for i, it := range req.Items {
		skus[i] = it.SKU
	}
	known, err := prices(ctx, tx, skus)
	if err != nil {
		return Order{}, err
	}
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

func jsonField(body []byte, field string) any {
	var m map[string]any
	_ = json.Unmarshal(body, &m)
	return m[field]
}
