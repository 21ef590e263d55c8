package loyalty

import (
	"errors"
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"

	"github.com/shop-ref/shop/internal/httpx"
)

// guide: http
// maxCustomerLen is the contract's longest customer id (api/openapi.yaml).
const maxCustomerLen = 64

// getPoints answers a customer's points: a 404 problem for a customer with
// no award, a 422 for what cannot be a customer id, a 503 when the database
// does not answer (httpx.WriteProblem), never the error's text.
func (s *Service) getPoints(w http.ResponseWriter, r *http.Request) {
	customer := chi.URLParam(r, "customer")
	if err := httpx.Text("customer", customer, maxCustomerLen); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	var points int64
	err := s.pool.QueryRow(r.Context(), `SELECT points FROM points WHERE customer_id = $1`, customer).Scan(&points)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		httpx.WriteProblem(w, r, s.log, httpx.NewProblem(http.StatusNotFound, "customer-not-found", "no points for this customer"))
	case err != nil:
		httpx.WriteProblem(w, r, s.log, err)
	default:
		httpx.WriteJSON(w, http.StatusOK, map[string]int64{"points": points})
	}
}

// guide: end http
