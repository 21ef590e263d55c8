package fulfillment

import (
	"errors"
	"net/http"

	"github.com/go-chi/chi/v5"

	"github.com/shop-ref/shop/internal/httpx"
)

// Routes mounts the service's HTTP API on r:
//
//	GET /shipments/{order_id}  the order's shipment, or a 404 problem
func (s *Service) Routes(r chi.Router) {
	r.Get("/shipments/{order_id}", s.getShipment)
}

func (s *Service) getShipment(w http.ResponseWriter, r *http.Request) {
	// Order ids are UUIDs; any other id names no shipment, which is what
	// the client needs to hear, without a query.
	id, ok := httpx.OrderID(chi.URLParam(r, "order_id"))
	if !ok {
		httpx.WriteProblem(w, r, s.log, problem(ErrNotFound, "this id"))
		return
	}
	sh, err := s.Shipment(r.Context(), id)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, problem(err, "order "+id.String()))
		return
	}
	httpx.WriteJSON(w, http.StatusOK, sh)
}

// problem maps the service's errors to HTTP problems; anything else stays an
// error and becomes a logged 500. order names the order in the detail (never
// the raw path parameter, which may be 10 KB of anything).
func problem(err error, order string) error {
	if errors.Is(err, ErrNotFound) {
		return httpx.NewProblem(http.StatusNotFound, "shipment-not-found", "no shipment for "+order)
	}
	return err
}
