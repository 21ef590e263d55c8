package inventory

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/go-chi/chi/v5"

	"github.com/shop-ref/shop/internal/httpx"
)

// maxAmount bounds on_hand and price: large enough for any shop, small
// enough that sums over many orders stay far from overflow.
const maxAmount = 1_000_000_000

// Routes mounts GET and PUT /stock/{sku} on r. PUT is an operator's
// restock: with an operator token configured it needs that token, checked
// before the body is read, so a refused request writes nothing.
func (s *Service) Routes(r chi.Router) {
	r.Get("/stock/{sku}", s.getStock)
	r.With(httpx.RequireBearer(s.operator, s.log)).Put("/stock/{sku}", s.putStock)
}

// putStockRequest is an operator's restock. Pointers tell a missing field
// from a zero.
type putStockRequest struct {
	OnHand *int64 `json:"on_hand"`
	Price  *int64 `json:"price"`
}

func (req putStockRequest) validate() error {
	switch {
	case req.OnHand == nil:
		return httpx.Invalid("on_hand is required")
	case req.Price == nil:
		return httpx.Invalid("price is required")
	case *req.OnHand < 0 || *req.OnHand > maxAmount:
		return httpx.Invalid("on_hand must be between 0 and %d", maxAmount)
	case *req.Price < 0 || *req.Price > maxAmount:
		return httpx.Invalid("price must be between 0 and %d cents", maxAmount)
	}
	return nil
}

func (s *Service) getStock(w http.ResponseWriter, r *http.Request) {
	sku := chi.URLParam(r, "sku")
	if !httpx.ValidSKU(sku) {
		s.fail(w, r, invalidSKU())
		return
	}
	st, err := getStock(r.Context(), s.pool, sku)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	httpx.WriteJSON(w, http.StatusOK, st)
}

// putStock sets a SKU's stock and price and emits ProductUpdated in the same
// transaction: a restock the order service never hears of cannot commit,
// and a refused one (any 4xx) writes nothing at all.
func (s *Service) putStock(w http.ResponseWriter, r *http.Request) {
	var req putStockRequest
	if _, err := httpx.Decode(r, &req); err != nil {
		s.fail(w, r, err)
		return
	}
	sku := chi.URLParam(r, "sku")
	if !httpx.ValidSKU(sku) {
		s.fail(w, r, invalidSKU())
		return
	}
	if err := req.validate(); err != nil {
		s.fail(w, r, err)
		return
	}
	ctx := r.Context()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		s.fail(w, r, fmt.Errorf("begin: %w", err))
		return
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	st, err := setStock(ctx, tx, sku, *req.OnHand, *req.Price)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if err := s.outbox.Add(ctx, tx, productEvent(st)); err != nil {
		s.fail(w, r, err)
		return
	}
	if err := tx.Commit(ctx); err != nil {
		s.fail(w, r, fmt.Errorf("commit stock %s: %w", sku, err))
		return
	}
	s.log.Info("stock set", "sku", sku, "on_hand", st.OnHand, "price", st.Price)
	httpx.WriteJSON(w, http.StatusOK, st)
}

// invalidSKU answers a path whose SKU does not have the contract's syntax
// (httpx.ValidSKU), before any query: a NUL or invalid UTF-8 would fail it
// with a 500. The value is not echoed; it may be 10 KB of anything.
func invalidSKU() error {
	return httpx.Invalid("sku must match [A-Za-z0-9_-]{1,64}")
}

// fail maps err to its problem response: the one place where the service's
// errors meet HTTP status codes.
func (s *Service) fail(w http.ResponseWriter, r *http.Request, err error) {
	var below *BelowReservedError
	switch {
	case errors.As(err, &below):
		err = httpx.NewProblem(http.StatusConflict, "below-reserved", fmt.Sprintf(
			"on_hand %d is below the %d units reserved for open orders", below.OnHand, below.Reserved))
	case errors.Is(err, ErrNotFound):
		err = httpx.NewProblem(http.StatusNotFound, "sku-not-found", "no stock is recorded for this sku")
	}
	httpx.WriteProblem(w, r, s.log, err)
}
