package order

import (
	"errors"
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/pkg/saga"
)

// Routes mounts the order API on r.
func (s *Service) Routes(r chi.Router) {
	r.Post("/orders", s.createOrder)
	r.Get("/orders/{id}", s.getOrder)
	r.Post("/orders/{id}/cancel", s.cancelOrder)
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

// orderID is the order id of the request's path; one that cannot be an
// order id (httpx.OrderID) is the 404 of an unknown order, answered without
// a query.
func orderID(r *http.Request) (uuid.UUID, error) {
	id, ok := httpx.OrderID(chi.URLParam(r, "id"))
	if !ok {
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
