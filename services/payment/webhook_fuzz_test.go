package payment

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/shop-ref/shop/internal/httpx"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/proof/pgtest"
)

// fuzzNow is the fuzz tests' clock: any fixed time well after 1970.
var fuzzNow = time.Unix(1_800_000_000, 0)

// FuzzWebhookSignature feeds the Payment-Signature parser and verifier
// arbitrary headers, bodies, secrets and clock skews. Neither may panic;
// every refusal is one of the four documented errors; and the verifier
// accepts exactly when an independent HMAC-SHA256 of "<t>.<body>" under the
// secret is among the v1 entries and t is within SignatureTolerance of now.
// A header made by Sign verifies iff its skew is within the tolerance, and
// never for another body or another secret.
//
//	go test -run '^$' -fuzz FuzzWebhookSignature -fuzztime 60s ./services/payment/
func FuzzWebhookSignature(f *testing.F) {
	body := []byte(`{"order_id":"o-1","provider_payment_id":"p-1","status":"succeeded","amount":1999}`)
	f.Add(Sign("s", fuzzNow, body), body, "s", int64(0))
	f.Add("t=1800000000,v1="+strings.Repeat("ab", 32), []byte(nil), "", int64(301))
	f.Add("", []byte("{}"), "secret", int64(-300))

	f.Fuzz(func(t *testing.T, header string, body []byte, secret string, skew int64) {
		sig, perr := parseSignature(header)
		if perr != nil {
			if !errors.Is(perr, ErrNoSignature) && !errors.Is(perr, ErrMalformedSignature) {
				t.Fatalf("parse %q: undocumented error %v", header, perr)
			}
		} else {
			n, err := strconv.ParseInt(sig.ts, 10, 64)
			if err != nil || n <= 0 || strings.TrimLeft(sig.ts, "0123456789") != "" || !sig.at.Equal(time.Unix(n, 0)) {
				t.Fatalf("parse %q: timestamp %q / %v", header, sig.ts, sig.at)
			}
			if !strings.Contains(header, "t="+sig.ts) {
				t.Fatalf("parse %q: timestamp %q is not what was sent", header, sig.ts)
			}
			if len(sig.v1s) == 0 {
				t.Fatalf("parse %q: accepted with no v1", header)
			}
			for _, v := range sig.v1s {
				if len(v) != sha256.Size {
					t.Fatalf("parse %q: v1 of %d bytes", header, len(v))
				}
			}
		}

		// The verifier against an oracle written without the package's code.
		err := verifySignature(secret, header, body, fuzzNow)
		switch {
		case err == nil:
			if perr != nil {
				t.Fatalf("verified %q, which does not parse: %v", header, perr)
			}
			h := hmac.New(sha256.New, []byte(secret))
			h.Write([]byte(sig.ts + "." + string(body)))
			want := hex.EncodeToString(h.Sum(nil))
			if !strings.Contains(strings.ToLower(header), "v1="+want) {
				t.Fatalf("verified %q without the right MAC %s", header, want)
			}
			if d := fuzzNow.Sub(sig.at); d > SignatureTolerance || d < -SignatureTolerance {
				t.Fatalf("verified %q, %s away from now", header, d)
			}
		case !errors.Is(err, ErrNoSignature) && !errors.Is(err, ErrMalformedSignature) &&
			!errors.Is(err, ErrSignatureExpired) && !errors.Is(err, ErrSignatureMismatch):
			t.Fatalf("verify %q: undocumented error %v", header, err)
		}

		// A signature made by Sign: accepted iff inside the window.
		skew %= 1_000_000_000 // seconds; keeps the timestamp positive
		signed := Sign(secret, fuzzNow.Add(time.Duration(skew)*time.Second), body)
		inside := skew*int64(time.Second) <= int64(SignatureTolerance) && -skew*int64(time.Second) <= int64(SignatureTolerance)
		switch err := verifySignature(secret, signed, body, fuzzNow); {
		case inside && err != nil:
			t.Fatalf("Sign(skew %ds) refused: %v", skew, err)
		case !inside && !errors.Is(err, ErrSignatureExpired):
			t.Fatalf("Sign(skew %ds) outside the window: err %v, want ErrSignatureExpired", skew, err)
		}
		if err := verifySignature(secret, signed, append(bytes.Clone(body), ' '), fuzzNow); !errors.Is(err, ErrSignatureMismatch) {
			t.Fatalf("signature accepted for another body: %v", err)
		}
		if err := verifySignature(secret+"x", signed, body, fuzzNow); !errors.Is(err, ErrSignatureMismatch) {
			t.Fatalf("signature accepted under another secret: %v", err)
		}
	})
}

// noJetStream satisfies New's check; the webhook path never publishes
// (events go through the outbox), so any call would panic and show up.
type noJetStream struct{ jetstream.JetStream }

// FuzzWebhook drives the real POST /webhooks/payment handler, against its
// own schema, with arbitrary bodies, content types and signature headers.
// An empty header stands for "correctly signed now", so the fuzzer reaches
// the body decoder and the database. It must never panic or answer 500;
// every refusal is a problem+json (401 for any signature that does not
// verify, else 400/404/409/413/415/422) and writes nothing; only a 200 that
// is not a replay adds a payment and an outbox event, and a refund when it
// is a rejected success of more than nothing.
//
//	go test -run '^$' -fuzz '^FuzzWebhook$' -fuzztime 60s ./services/payment/
func FuzzWebhook(f *testing.F) {
	db := pgtest.New(f, Registration.Sets()...)
	ctx := context.Background()
	// Intents in each state the handler treats differently.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO intents (order_id, state, amount) VALUES
		('o-1', 'PAYABLE', 1999), ('o-paid', 'PAID', 700),
		('o-closed', 'CLOSED', 0), ('o-max', 'PAYABLE', 9223372036854775807)`); err != nil {
		f.Fatal(err)
	}
	svc, err := New(registry.Deps{Pool: db.Pool, JetStream: noJetStream{}}, Config{WebhookSecret: testSecret, Now: func() time.Time { return fuzzNow }})
	if err != nil {
		f.Fatal(err)
	}
	r := chi.NewRouter()
	svc.Routes(r)

	f.Add([]byte(`{"order_id":"o-1","provider_payment_id":"p-1","status":"succeeded","amount":1999}`), "application/json", "")
	f.Add(bytes.Repeat([]byte(" "), httpx.MaxBody+1), "application/json", "")
	f.Add([]byte(`{"order_id":"o-1","provider_payment_id":"p-2","status":"failed","amount":1999}`), "text/plain", "")

	counts := func(t *testing.T) [3]int {
		var c [3]int
		if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM outbox), (SELECT count(*) FROM refunds)`).
			Scan(&c[0], &c[1], &c[2]); err != nil {
			t.Fatal(err)
		}
		return c
	}

	f.Fuzz(func(t *testing.T, body []byte, contentType, header string) {
		signedByUs := header == ""
		if signedByUs {
			header = Sign(testSecret, fuzzNow, body)
		}
		req := httptest.NewRequest(http.MethodPost, "/webhooks/payment", bytes.NewReader(body))
		req.Header.Set("Content-Type", contentType)
		req.Header.Set(SignatureHeader, header)
		before := counts(t)
		rec := httptest.NewRecorder()
		r.ServeHTTP(rec, req)
		after := counts(t)

		status := rec.Code
		if status == http.StatusOK {
			if verifySignature(testSecret, header, body, fuzzNow) != nil {
				t.Fatalf("accepted a callback whose signature does not verify: %q", header)
			}
			var cb Callback
			if err := httpx.DecodeBytes(body, &cb); err != nil || validateCallback(cb) != nil {
				t.Fatalf("accepted a body the decoder refuses: %q", body)
			}
			var res struct{ Status, Reason string }
			if err := json.Unmarshal(rec.Body.Bytes(), &res); err != nil {
				t.Fatalf("answer %s: %v", rec.Body, err)
			}
			if (res.Status == StatusRejected) != (res.Reason != "") || res.Status == StatusRejected && cb.Status != StatusSucceeded {
				t.Fatalf("callback %q answered %s", body, rec.Body)
			}
			want := [3]int{before[0] + 1, before[1] + 1, before[2]}
			if res.Status == StatusRejected && cb.Amount > 0 {
				want[2]++
			}
			if rec.Header().Get("Idempotent-Replayed") == "true" {
				want = before
			}
			if after != want {
				t.Fatalf("200 %s (replayed %q): payments/outbox/refunds %v -> %v", rec.Body, rec.Header().Get("Idempotent-Replayed"), before, after)
			}
			return
		}
		switch status {
		case http.StatusBadRequest, http.StatusUnauthorized, http.StatusNotFound, http.StatusConflict,
			http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType, http.StatusUnprocessableEntity:
		default:
			t.Fatalf("status %d for body %q, content type %q, header %q: %s", status, body, contentType, header, rec.Body)
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
			t.Fatalf("refusal %d with Content-Type %q", status, ct)
		}
		var p httpx.Problem
		if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil || p.Status != status || p.Code == "" {
			t.Fatalf("refusal %d is not a problem: %s", status, rec.Body)
		}
		if len(body) <= httpx.MaxBody && verifySignature(testSecret, header, body, fuzzNow) != nil && status != http.StatusUnauthorized {
			t.Fatalf("bad signature %q answered %d, want 401", header, status)
		}
		if after != before {
			t.Fatalf("refusal %d wrote: payments/outbox/refunds %v -> %v", status, before, after)
		}
	})
}
