package payment

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/poll"
)

// nothingWritten fails unless no payment and no outbox row exist.
func (e *env) nothingWritten(t *testing.T) {
	t.Helper()
	if n := e.count(t, `SELECT count(*) FROM payments`); n != 0 {
		t.Fatalf("%d payments written, want none", n)
	}
	outboxtest.RequireNotWritten(t, e.db.Pool, outboxtest.Want{})
}

func TestWebhookSignature(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order := e.intent(t, StatePayable, 1999)
	body := mustJSON(t, Callback{OrderID: order, ProviderPaymentID: "pay_sig", Status: StatusSucceeded, Amount: 1999})
	now := e.clock()

	refused := []struct {
		name string
		body []byte
		sig  string
	}{
		{"missing", body, ""},
		{"wrong secret", body, Sign("not-the-secret", now, body)},
		{"garbage", body, "nonsense"},
		{"no v1", body, "t=" + itoa(now.Unix())},
		{"expired", body, Sign(testSecret, now.Add(-SignatureTolerance-time.Second), body)},
		{"from the future", body, Sign(testSecret, now.Add(SignatureTolerance+time.Second), body)},
		{"tampered body", []byte(strings.Replace(string(body), "1999", "1", 1)), Sign(testSecret, now, body)},
		{"timestamp moved", body, strings.Replace(Sign(testSecret, now.Add(-time.Hour), body), itoa(now.Add(-time.Hour).Unix()), itoa(now.Unix()), 1)},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			rec := e.callback(t, tc.body, tc.sig)
			wantProblem(t, rec, http.StatusUnauthorized, "invalid-signature")
			// RFC 9110: every 401 carries a challenge.
			if got := rec.Header().Get("WWW-Authenticate"); got != SignatureChallenge {
				t.Errorf("WWW-Authenticate %q, want %q", got, SignatureChallenge)
			}
			e.nothingWritten(t)
		})
	}

	t.Run("valid inside the tolerance", func(t *testing.T) {
		// Signed 4 minutes ago by the provider's clock: still accepted.
		wantStatus(t, e.callback(t, body, Sign(testSecret, now.Add(-4*time.Minute), body)), http.StatusOK)
		if n := e.count(t, `SELECT count(*) FROM payments`); n != 1 {
			t.Fatalf("%d payments, want 1", n)
		}
	})

	t.Run("the service clock moves past the tolerance", func(t *testing.T) {
		sig := Sign(testSecret, e.clock(), body)
		e.advance(SignatureTolerance + time.Second)
		wantProblem(t, e.callback(t, body, sig), http.StatusUnauthorized, "invalid-signature")
	})
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func TestWebhookRefusals(t *testing.T) {
	t.Parallel()
	e := setup(t)
	payable := e.intent(t, StatePayable, 500)

	cases := []struct {
		name   string
		body   string
		ctype  string
		status int
		code   string
	}{
		// A failure moved no money: one that cannot be applied is refused
		// and writes nothing (a success is recorded and refunded, see
		// TestRejectedPaymentsAreRecordedAndRefunded).
		{"failure for an unknown order", `{"order_id":"` + uuid.NewString() + `","provider_payment_id":"p1","status":"failed","amount":500}`, "", http.StatusNotFound, "order-not-found"},
		{"failure of another amount", `{"order_id":"` + payable + `","provider_payment_id":"p3","status":"failed","amount":499}`, "", http.StatusUnprocessableEntity, "amount-mismatch"},
		{"order id that is no subject token", `{"order_id":"o.1","provider_payment_id":"p10","status":"succeeded","amount":500}`, "", http.StatusUnprocessableEntity, "invalid-request"},
		{"order id with a space", `{"order_id":"o 1","provider_payment_id":"p11","status":"succeeded","amount":500}`, "", http.StatusUnprocessableEntity, "invalid-request"},
		{"bad JSON", `{"order_id":`, "", http.StatusBadRequest, "malformed-json"},
		{"unknown field", `{"order_id":"` + payable + `","provider_payment_id":"p4","status":"succeeded","amount":500,"x":1}`, "", http.StatusBadRequest, "malformed-json"},
		{"wrong type", `{"order_id":"` + payable + `","provider_payment_id":"p5","status":"succeeded","amount":"500"}`, "", http.StatusBadRequest, "malformed-json"},
		{"unknown status", `{"order_id":"` + payable + `","provider_payment_id":"p6","status":"pending","amount":500}`, "", http.StatusUnprocessableEntity, "invalid-request"},
		{"no provider id", `{"order_id":"` + payable + `","status":"succeeded","amount":500}`, "", http.StatusUnprocessableEntity, "invalid-request"},
		{"not JSON", `order_id=x`, "application/x-www-form-urlencoded", http.StatusUnsupportedMediaType, "unsupported-media-type"},
		{"too large", `{"order_id":"` + strings.Repeat("x", 70<<10) + `"}`, "", http.StatusRequestEntityTooLarge, "body-too-large"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			h := http.Header{"Content-Type": {"application/json"}, SignatureHeader: {Sign(testSecret, e.clock(), body)}}
			if tc.ctype != "" {
				h.Set("Content-Type", tc.ctype)
			}
			wantProblem(t, e.do(t, http.MethodPost, "/webhooks/payment", body, h), tc.status, tc.code)
			e.nothingWritten(t)
		})
	}
}

type outboxRow struct {
	Type, Subject, AggregateType, AggregateID string
	Payload                                   map[string]any
}

func (e *env) outboxRows(t *testing.T, typ string) []outboxRow {
	t.Helper()
	var out []outboxRow
	for _, rec := range outboxtest.Written(t, e.db.Pool, outboxtest.Want{Type: typ}) {
		r := outboxRow{Type: rec.Type, Subject: rec.Subject, AggregateType: rec.AggregateType, AggregateID: rec.AggregateID}
		if err := json.Unmarshal(rec.Payload, &r.Payload); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	return out
}

func decodeResult(t *testing.T, body []byte) (paymentID, status string) {
	t.Helper()
	var res struct {
		PaymentID string `json:"payment_id"`
		Status    string `json:"status"`
	}
	if err := json.Unmarshal(body, &res); err != nil {
		t.Fatalf("result %s: %v", body, err)
	}
	return res.PaymentID, res.Status
}

func TestWebhookRecordsPaymentAndEvent(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order := e.intent(t, StatePayable, 2500)
	cb := Callback{OrderID: order, ProviderPaymentID: "pay_ok", Status: StatusSucceeded, Amount: 2500}

	rec := e.signed(t, cb)
	wantStatus(t, rec, http.StatusOK)
	paymentID, status := decodeResult(t, rec.Body.Bytes())
	if status != StatusSucceeded || paymentID == "" {
		t.Fatalf("result %s", rec.Body)
	}
	evs := e.outboxRows(t, EventPaymentSucceeded)
	if len(evs) != 1 {
		t.Fatalf("%d PaymentSucceeded events, want 1", len(evs))
	}
	ev := evs[0]
	if ev.Subject != "payment."+order+".PaymentSucceeded" || ev.AggregateType != "order" || ev.AggregateID != order {
		t.Fatalf("event %+v", ev)
	}
	if ev.Payload["order_id"] != order || ev.Payload["payment_id"] != paymentID ||
		ev.Payload["provider_payment_id"] != "pay_ok" || ev.Payload["amount"] != float64(2500) {
		t.Fatalf("payload %v", ev.Payload)
	}

	t.Run("replay changes nothing", func(t *testing.T) {
		e.advance(time.Minute) // a later delivery, freshly signed
		rec := e.signed(t, cb)
		wantStatus(t, rec, http.StatusOK)
		if id, _ := decodeResult(t, rec.Body.Bytes()); id != paymentID {
			t.Fatalf("replay answered payment %s, want %s", id, paymentID)
		}
		if rec.Header().Get("Idempotent-Replayed") != "true" {
			t.Error("replay not marked Idempotent-Replayed")
		}
		if n := e.count(t, `SELECT count(*) FROM payments`); n != 1 {
			t.Fatalf("%d payments, want 1", n)
		}
		outboxtest.RequireWritten(t, e.db.Pool, outboxtest.Want{})
	})

	t.Run("same provider id with other details is a conflict", func(t *testing.T) {
		other := cb
		other.Status = StatusFailed
		wantProblem(t, e.signed(t, other), http.StatusConflict, "payment-conflict")
	})

	t.Run("failed callback emits PaymentFailed", func(t *testing.T) {
		order := e.intent(t, StatePayable, 700)
		wantStatus(t, e.signed(t, Callback{OrderID: order, ProviderPaymentID: "pay_no", Status: StatusFailed, Amount: 700}), http.StatusOK)
		evs := e.outboxRows(t, EventPaymentFailed)
		if len(evs) != 1 || evs[0].AggregateID != order || evs[0].Payload["reason"] == "" {
			t.Fatalf("PaymentFailed events %+v", evs)
		}
	})
}

func TestConcurrentTwinCallbacksRecordOnePayment(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order := e.intent(t, StatePayable, 900)
	cb := Callback{OrderID: order, ProviderPaymentID: "pay_twin", Status: StatusSucceeded, Amount: 900}
	var wg sync.WaitGroup
	ids := make([]string, 8)
	for i := range ids {
		wg.Go(func() {
			rec := e.signed(t, cb)
			if rec.Code != http.StatusOK {
				t.Errorf("twin %d: status %d %s", i, rec.Code, rec.Body)
				return
			}
			ids[i], _ = decodeResult(t, rec.Body.Bytes())
		})
	}
	wg.Wait()
	for _, id := range ids {
		if id != ids[0] {
			t.Fatalf("twins answered different payments: %v", ids)
		}
	}
	if n := e.count(t, `SELECT count(*) FROM payments`); n != 1 {
		t.Fatalf("%d payments, want 1", n)
	}
	outboxtest.RequireWritten(t, e.db.Pool, outboxtest.Want{})
}

func TestSimulate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order := e.intent(t, StatePayable, 4200)
	hdr := http.Header{"Content-Type": {"application/json"}}

	rec := e.do(t, http.MethodPost, "/payments/"+order+"/simulate", []byte(`{"outcome":"succeeded"}`), hdr)
	wantStatus(t, rec, http.StatusOK)
	paymentID, status := decodeResult(t, rec.Body.Bytes())
	if status != StatusSucceeded {
		t.Fatalf("simulate: %s", rec.Body)
	}
	evs := e.outboxRows(t, EventPaymentSucceeded)
	if len(evs) != 1 || evs[0].Payload["payment_id"] != paymentID || evs[0].Payload["amount"] != float64(4200) {
		t.Fatalf("events %+v", evs)
	}

	// The intent took its payment: a second charge is refused before any
	// money moves, whatever its outcome.
	for _, outcome := range []string{"succeeded", "failed"} {
		rec = e.do(t, http.MethodPost, "/payments/"+order+"/simulate", []byte(`{"outcome":"`+outcome+`"}`), hdr)
		wantProblem(t, rec, http.StatusConflict, "already-paid")
		if rec.Header().Get("Retry-After") != "" {
			t.Fatalf("already-paid carries Retry-After: it is final")
		}
	}

	// A decline closes the intent: a later charge is refused too.
	declined := e.intent(t, StatePayable, 4200)
	rec = e.do(t, http.MethodPost, "/payments/"+declined+"/simulate", []byte(`{"outcome":"failed"}`), hdr)
	wantStatus(t, rec, http.StatusOK)
	if _, status := decodeResult(t, rec.Body.Bytes()); status != StatusFailed {
		t.Fatalf("simulate failed: %s", rec.Body)
	}
	wantProblem(t, e.do(t, http.MethodPost, "/payments/"+declined+"/simulate", []byte(`{"outcome":"succeeded"}`), hdr), http.StatusConflict, "order-not-payable")

	rec = e.do(t, http.MethodGet, "/payments/"+order, nil, nil)
	wantStatus(t, rec, http.StatusOK)
	var got struct {
		State    string    `json:"state"`
		Payments []Payment `json:"payments"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil || got.State != StatePaid || len(got.Payments) != 1 {
		t.Fatalf("GET: %s (%v)", rec.Body, err)
	}
	if n := e.count(t, `SELECT count(*) FROM payments WHERE order_id = $1`, declined); n != 1 {
		t.Fatalf("%d payments of the declined order, want its one failure", n)
	}

	wantProblem(t, e.do(t, http.MethodPost, "/payments/"+uuid.NewString()+"/simulate", []byte(`{"outcome":"succeeded"}`), hdr), http.StatusNotFound, "order-not-found")
	wantProblem(t, e.do(t, http.MethodPost, "/payments/"+order+"/simulate", []byte(`{"outcome":"maybe"}`), hdr), http.StatusUnprocessableEntity, "invalid-request")
	wantProblem(t, e.do(t, http.MethodGet, "/payments/"+uuid.NewString(), nil, nil), http.StatusNotFound, "order-not-found")
}

// The contract's maxLength counts characters: a provider payment id of 255
// four-byte emoji (1020 bytes) is a valid id, one of 256 is not.
func TestCallbackIDLengthsCountCharacters(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order := e.intent(t, StatePayable, 700)
	const emoji = "\U0001F600"
	wantStatus(t, e.signed(t, Callback{OrderID: order, ProviderPaymentID: strings.Repeat(emoji, maxIDLen), Status: StatusSucceeded, Amount: 700}), http.StatusOK)
	wantProblem(t, e.signed(t, Callback{OrderID: order, ProviderPaymentID: strings.Repeat(emoji, maxIDLen+1), Status: StatusSucceeded, Amount: 700}),
		http.StatusUnprocessableEntity, "invalid-request")
	wantProblem(t, e.signed(t, Callback{OrderID: strings.Repeat(emoji, maxIDLen+1), ProviderPaymentID: "p-long-order", Status: StatusSucceeded, Amount: 700}),
		http.StatusUnprocessableEntity, "invalid-request")
	if n := e.count(t, `SELECT count(*) FROM payments`); n != 1 {
		t.Fatalf("%d payments, want the one of 255 characters", n)
	}
}

// A path's order id that cannot be one (NUL and invalid UTF-8, which
// Postgres refuses, a 10 KB value, a traversal) is the 404 of an unknown
// order, answered before any query: it used to reach Postgres and be a 500.
func TestPathsRefuseWhatCannotBeAnOrderID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	order := e.intent(t, StatePayable, 300)
	hdr := http.Header{"Content-Type": {"application/json"}}
	for _, id := range []string{"%00", "%FF", order + "%00", strings.Repeat("a", 10<<10), "..%2F..", "o-1"} {
		wantProblem(t, e.do(t, http.MethodGet, "/payments/"+id, nil, nil), http.StatusNotFound, "order-not-found")
		wantProblem(t, e.do(t, http.MethodPost, "/payments/"+id+"/simulate", []byte(`{"outcome":"succeeded"}`), hdr), http.StatusNotFound, "order-not-found")
	}
	e.nothingWritten(t)
	// The canonical form in either case names the order.
	wantStatus(t, e.do(t, http.MethodGet, "/payments/"+strings.ToUpper(order), nil, nil), http.StatusOK)
}

// The demo's simulate endpoint exists only with the fake provider switched
// on: off (New's default), any client could otherwise have the provider
// sign a "succeeded" callback for any order.
func TestSimulateOnlyWithTheFakeProvider(t *testing.T) {
	t.Parallel()
	e := newEnv(t) // Simulate on, as the other tests need it
	order := e.intent(t, StatePayable, 4200)
	off, err := New(registry.Deps{Pool: e.db.Pool, JetStream: e.js}, Config{WebhookSecret: testSecret, Provider: e.provider})
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	off.Routes(r)
	req := httptest.NewRequest(http.MethodPost, "/payments/"+order+"/simulate", strings.NewReader(`{"outcome":"succeeded"}`))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	r.ServeHTTP(rec, req)
	if rec.Code != http.StatusNotFound || rec.Header().Get("Content-Type") == "application/problem+json" {
		t.Fatalf("simulate with the fake provider off: %d %q %s, want the router's 404", rec.Code, rec.Header().Get("Content-Type"), rec.Body)
	}
	if n := e.count(t, `SELECT count(*) FROM payments`); n != 0 {
		t.Fatalf("%d payments", n)
	}
	// The webhook and the operator's view are there either way.
	rec = httptest.NewRecorder()
	r.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/payments/"+order, nil))
	wantStatus(t, rec, http.StatusOK)

	// On: the same request pays.
	wantStatus(t, e.do(t, http.MethodPost, "/payments/"+order+"/simulate", []byte(`{"outcome":"succeeded"}`),
		http.Header{"Content-Type": {"application/json"}}), http.StatusOK)
}

// The callback transaction begins in the batch of its first reads, so every
// way out of it, refusals and replays included, must end it: a connection
// left in an open transaction would never return to the pool.
func TestCallbacksGiveTheirConnectionBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t) // nothing running: the test's requests are the pool's only users
	payable := e.intent(t, StatePayable, 300)
	closed := e.intent(t, StateClosed, 300)
	ok := Callback{OrderID: payable, ProviderPaymentID: "pay_conn", Status: StatusSucceeded, Amount: 300}
	conflict := ok
	conflict.Status = StatusFailed
	mismatch := ok
	mismatch.ProviderPaymentID, mismatch.Amount = "pay_conn_2", 299

	failedMismatch := mismatch
	failedMismatch.ProviderPaymentID, failedMismatch.Status = "pay_conn_3", StatusFailed
	for _, tc := range []struct {
		name   string
		cb     Callback
		status int
	}{
		{"recorded", ok, http.StatusOK},
		{"replayed", ok, http.StatusOK},
		{"conflict", conflict, http.StatusConflict},
		{"amount mismatch: rejected", mismatch, http.StatusOK},
		{"closed order: applied (the saga refunds it)", Callback{OrderID: closed, ProviderPaymentID: "pay_p", Status: StatusSucceeded, Amount: 300}, http.StatusOK},
		{"unknown order: rejected", Callback{OrderID: uuid.NewString(), ProviderPaymentID: "pay_u", Status: StatusSucceeded, Amount: 300}, http.StatusOK},
		{"same provider id for another order: conflict", Callback{OrderID: uuid.NewString(), ProviderPaymentID: "pay_u", Status: StatusSucceeded, Amount: 300}, http.StatusConflict},
		{"failure of another amount: refused", failedMismatch, http.StatusUnprocessableEntity},
		{"failure for an unknown order: refused", Callback{OrderID: uuid.NewString(), ProviderPaymentID: "pay_f", Status: StatusFailed, Amount: 300}, http.StatusNotFound},
	} {
		if rec := e.signed(t, tc.cb); rec.Code != tc.status {
			t.Fatalf("%s: status %d %s, want %d", tc.name, rec.Code, rec.Body, tc.status)
		}
		poll.Until(t, 30*time.Second, tc.name+": the connection released", func() bool { return e.db.Pool.Stat().AcquiredConns() == 0 })
	}
	if n := e.count(t, `SELECT count(*) FROM payments`); n != 4 {
		t.Fatalf("%d payments, want 4 (two applied, two rejected)", n)
	}
}
