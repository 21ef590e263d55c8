package payment

import (
	"bytes"
	"errors"
	"net/http"
	"strings"
	"unicode"

	"github.com/go-chi/chi/v5"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/httpx"
)

// Routes mounts the payment endpoints on r; the demo's simulate endpoint
// only when Config.Simulate is on (without it, the path does not exist:
// 404).
func (s *Service) Routes(r chi.Router) {
	r.Post("/webhooks/payment", s.handleWebhook)
	if s.cfg.Simulate {
		r.Post("/payments/{order_id}/simulate", s.handleSimulate)
	}
	r.Get("/payments/{order_id}", s.handleGet)
}

// maxIDLen bounds the ids a callback may carry.
const maxIDLen = 255

// handleWebhook is the provider's callback. The signature is checked on
// the raw bytes before anything is parsed or written: decoding first would
// act on unauthenticated input, and re-encoding would not reproduce the
// bytes that were signed. A success for an intent that no longer takes one
// is money the provider already took: it is recorded as rejected and
// refunded, and answered 200.
func (s *Service) handleWebhook(w http.ResponseWriter, r *http.Request) {
	s.serveCallback(w, r, received{at: s.cfg.Now()})
}

// serveCallback is handleWebhook for a callback received as rc.
func (s *Service) serveCallback(w http.ResponseWriter, r *http.Request, rc received) {
	body, err := httpx.ReadBody(r)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	if err := verifySignature(s.cfg.WebhookSecret, r.Header.Get(SignatureHeader), body, s.cfg.Now()); err != nil {
		// The reason is logged, not returned: a forger learns nothing.
		s.log.Warn("webhook signature refused", "reason", err, "remote", r.RemoteAddr)
		// RFC 9110 §15.5.2: a 401 carries a challenge naming how to
		// authenticate, here the signature header the callback lacks.
		w.Header().Set("WWW-Authenticate", SignatureChallenge)
		httpx.WriteProblem(w, r, s.log, httpx.NewProblem(http.StatusUnauthorized, "invalid-signature",
			"the Payment-Signature header is missing, malformed, expired or wrong"))
		return
	}
	if err := httpx.RequireJSON(r); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	var cb Callback
	if err := httpx.DecodeBytes(body, &cb); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	if err := validateCallback(cb); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	p, replayed, err := s.recordCallback(r.Context(), cb, rc)
	if err != nil {
		httpx.WriteProblem(w, r, s.log, problemOf(err))
		return
	}
	// Failure window: the payment and its event are committed, the
	// provider has no answer. It sends the callback again; the provider
	// payment id makes that a harmless replay. An injected error drops the
	// connection without a response, as a crash would.
	if err := s.hooks.Failpoint(failpoint.PaymentWebhookAfterCommitBeforeResponse); err != nil {
		s.log.Warn("payment failpoint: dropping the webhook response", "err", err)
		panic(http.ErrAbortHandler)
	}
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	// A rejected payment is 200 too: the callback is recorded and its money
	// is on its way back, so there is nothing for the provider to send
	// again, and a 4xx would make it retry for days what is already done.
	res := map[string]any{"payment_id": p.PaymentID, "status": p.Status}
	if p.Status == StatusRejected {
		res["reason"] = p.RejectReason
	}
	httpx.WriteJSON(w, http.StatusOK, res)
}

func validateCallback(cb Callback) error {
	// 1 to 255 characters (code points, as the contract's maxLength counts
	// them), printable only: control characters (NUL above all, which
	// Postgres text cannot hold) would fail the database with a 500, and a
	// provider retries a 500 for ever; found by FuzzWebhook.
	if err := httpx.Text("order_id", cb.OrderID, maxIDLen); err != nil {
		return err
	}
	if err := httpx.Text("provider_payment_id", cb.ProviderPaymentID, maxIDLen); err != nil {
		return err
	}
	switch {
	case cb.Status != StatusSucceeded && cb.Status != StatusFailed:
		return httpx.Invalid("status must be %q or %q", StatusSucceeded, StatusFailed)
	case cb.Amount < 0:
		return httpx.Invalid("amount must not be negative")
	case strings.ContainsAny(cb.OrderID, ".*>") || strings.ContainsFunc(cb.OrderID, unicode.IsSpace):
		// Payment's events about an order go to payment.<order_id>.<Type>,
		// and a success for an order payment does not know is recorded and
		// announced too: an id that cannot be one subject token would make
		// its event unpublishable. No order of the shop has such an id.
		return httpx.Invalid("order_id may not contain '.', '*', '>' or spaces: it is no order id of this shop")
	}
	return nil
}

// handleSimulate asks the fake provider to charge the order. The provider
// signs a callback and it goes through the webhook's path like any other,
// so the demo exercises the real verification and recording path, with one
// difference: the customer is asking, not telling. A charge for an intent
// that no longer takes one (its deadline passed, the order closed, or it
// is paid) is refused in the transaction that would have recorded it,
// 409, and nothing is captured, as a real provider refuses to charge an
// intent the shop cancelled.
func (s *Service) handleSimulate(w http.ResponseWriter, r *http.Request) {
	asked := s.cfg.Now() // the moment the customer paid
	var req struct {
		Outcome string `json:"outcome"`
	}
	if _, err := httpx.Decode(r, &req); err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	if req.Outcome != StatusSucceeded && req.Outcome != StatusFailed {
		httpx.WriteProblem(w, r, s.log, httpx.Invalid("outcome must be %q or %q", StatusSucceeded, StatusFailed))
		return
	}
	id, ok := httpx.OrderID(chi.URLParam(r, "order_id"))
	if !ok {
		httpx.WriteProblem(w, r, s.log, problemOf(ErrNotFound))
		return
	}
	in, err := getIntent(r.Context(), s.pool, id.String())
	if err != nil {
		httpx.WriteProblem(w, r, s.log, problemOf(err))
		return
	}
	body, sig, err := s.provider.Charge(in.OrderID, in.Amount, req.Outcome, s.cfg.WebhookSecret, s.cfg.Now())
	if err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	cb, err := http.NewRequestWithContext(r.Context(), http.MethodPost, "/webhooks/payment", bytes.NewReader(body))
	if err != nil {
		httpx.WriteProblem(w, r, s.log, err)
		return
	}
	cb.Header.Set("Content-Type", "application/json")
	cb.Header.Set(SignatureHeader, sig)
	cb.RemoteAddr = "fake-provider"
	rec := &recorder{header: http.Header{}}
	s.serveCallback(rec, cb, received{at: asked, refuseLate: true})
	for k, v := range rec.header {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.status)
	_, _ = w.Write(rec.body.Bytes())
}

// handleGet shows what payment knows of an order: its intent, payments and
// refunds. Provider ids are shown in full here: this is the operator's view.
//
// The path's order id is checked first (httpx.OrderID): intents are keyed by
// the shop's order ids, which are UUIDs, so anything else is a 404 without
// a query. Unchecked, a NUL or invalid UTF-8 reached Postgres and was a 500.
func (s *Service) handleGet(w http.ResponseWriter, r *http.Request) {
	id, ok := httpx.OrderID(chi.URLParam(r, "order_id"))
	if !ok {
		httpx.WriteProblem(w, r, s.log, problemOf(ErrNotFound))
		return
	}
	v, err := readOrderView(r.Context(), s.pool, id.String())
	if err != nil {
		httpx.WriteProblem(w, r, s.log, problemOf(err))
		return
	}
	httpx.WriteJSON(w, http.StatusOK, v)
}

// problemOf maps the domain errors to problem responses; anything else
// stays an error and becomes a logged 500.
func problemOf(err error) error {
	switch {
	case errors.Is(err, ErrNotFound):
		return httpx.NewProblem(http.StatusNotFound, "order-not-found", "payment knows no order with this id")
	case errors.Is(err, ErrAmountMismatch):
		return httpx.NewProblem(http.StatusUnprocessableEntity, "amount-mismatch", "amount differs from the order total")
	case errors.Is(err, ErrPaymentConflict):
		return httpx.NewProblem(http.StatusConflict, "payment-conflict",
			"this provider_payment_id was recorded with a different order, status or amount")
	case errors.Is(err, ErrWindowClosed):
		return httpx.NewProblem(http.StatusConflict, "payment-window-closed",
			"the order's payment window closed at its pay_by: nothing was charged, and the order is being closed")
	case errors.Is(err, ErrIntentClosed):
		return httpx.NewProblem(http.StatusConflict, "order-not-payable",
			"the order no longer takes a payment (it was closed, or its payment declined): nothing was charged")
	case errors.Is(err, ErrAlreadyPaid):
		return httpx.NewProblem(http.StatusConflict, "already-paid",
			"the order is paid already: nothing was charged")
	}
	return err
}

// recorder captures the response of the in-process webhook call made by
// handleSimulate.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(status int) {
	if r.status == 0 {
		r.status = status
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.body.Write(b)
}
