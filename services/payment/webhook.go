package payment

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// SignatureHeader carries the provider's signature of a webhook callback.
const SignatureHeader = "Payment-Signature"

// SignatureChallenge is the WWW-Authenticate of the webhook's 401: its
// scheme names the header that authenticates a callback, an HMAC signature
// rather than a credential of a standard scheme.
const SignatureChallenge = SignatureHeader + ` realm="payment-webhook"`

// SignatureTolerance is how far a callback's timestamp may be from now. It
// bounds how long a captured callback can be replayed by someone who is not
// the provider (a replay inside it is harmless: the provider payment id
// makes it a no-op).
const SignatureTolerance = 5 * time.Minute

// Errors of signature verification. All of them answer 401; they are
// distinct so that logs and tests can tell them apart.
var (
	ErrNoSignature        = errors.New("payment: no signature")
	ErrMalformedSignature = errors.New("payment: malformed signature header")
	ErrSignatureExpired   = errors.New("payment: signature timestamp outside tolerance")
	ErrSignatureMismatch  = errors.New("payment: signature does not match")
)

// Sign returns the Payment-Signature header value for body sent at t:
// "t=<unix>,v1=<hex HMAC-SHA256(secret, "<unix>.<body>")>", the scheme
// Stripe uses. The timestamp is inside the MAC, so it cannot be moved to
// get around the tolerance.
func Sign(secret string, t time.Time, body []byte) string {
	ts := strconv.FormatInt(t.Unix(), 10)
	return "t=" + ts + ",v1=" + hex.EncodeToString(mac(secret, ts, body))
}

func mac(secret, ts string, body []byte) []byte {
	h := hmac.New(sha256.New, []byte(secret))
	h.Write([]byte(ts))
	h.Write([]byte{'.'})
	h.Write(body)
	return h.Sum(nil)
}

// signature is a parsed Payment-Signature header.
type signature struct {
	ts  string // the timestamp exactly as sent: it is what was signed
	at  time.Time
	v1s [][]byte // every v1 entry: a provider rotating its secret sends one per secret
}

// parseSignature parses "t=<unix>,v1=<hex>[,v1=<hex>…]". Entries of other
// schemes (Stripe's v0) are ignored, as Stripe advises, so that a provider
// may add one; a missing or repeated t, or no usable v1, is malformed.
func parseSignature(header string) (signature, error) {
	var sig signature
	if strings.TrimSpace(header) == "" {
		return sig, ErrNoSignature
	}
	for part := range strings.SplitSeq(header, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok || v == "" {
			return sig, fmt.Errorf("%w: entry %q is not key=value", ErrMalformedSignature, part)
		}
		switch k {
		case "t":
			if sig.ts != "" {
				return sig, fmt.Errorf("%w: more than one timestamp", ErrMalformedSignature)
			}
			n, err := strconv.ParseInt(v, 10, 64)
			// Digits only: ParseInt accepts a sign, and "+123" would sign
			// differently from the number it means.
			if err != nil || n <= 0 || strings.TrimLeft(v, "0123456789") != "" {
				return sig, fmt.Errorf("%w: timestamp %q", ErrMalformedSignature, v)
			}
			sig.ts, sig.at = v, time.Unix(n, 0)
		case "v1":
			b, err := hex.DecodeString(v)
			if err != nil || len(b) != sha256.Size {
				return sig, fmt.Errorf("%w: v1 is not a hex SHA-256 MAC", ErrMalformedSignature)
			}
			sig.v1s = append(sig.v1s, b)
		}
	}
	switch {
	case sig.ts == "":
		return sig, fmt.Errorf("%w: no timestamp", ErrMalformedSignature)
	case len(sig.v1s) == 0:
		return sig, fmt.Errorf("%w: no v1 signature", ErrMalformedSignature)
	}
	return sig, nil
}

// verifySignature checks header against body: the MAC first, in constant
// time, then the timestamp against now. Checking the MAC before the clock
// means an attacker learns nothing about our clock from forged headers.
func verifySignature(secret, header string, body []byte, now time.Time) error {
	sig, err := parseSignature(header)
	if err != nil {
		return err
	}
	want := mac(secret, sig.ts, body)
	matched := false
	for _, v1 := range sig.v1s {
		// hmac.Equal runs in time independent of where the bytes differ,
		// so the MAC cannot be guessed byte by byte from response times.
		if hmac.Equal(v1, want) {
			matched = true
		}
	}
	if !matched {
		return ErrSignatureMismatch
	}
	if d := now.Sub(sig.at); d > SignatureTolerance || d < -SignatureTolerance {
		return ErrSignatureExpired
	}
	return nil
}
