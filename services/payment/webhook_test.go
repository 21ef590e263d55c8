package payment

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestParseSignature(t *testing.T) {
	t.Parallel()
	mac := strings.Repeat("ab", 32)
	good := []struct {
		name, header string
		ts           string
		v1s          int
	}{
		{"plain", "t=1700000000,v1=" + mac, "1700000000", 1},
		{"spaces around entries", " t=1700000000 , v1=" + mac + " ", "1700000000", 1},
		{"two v1 during secret rotation", "t=1700000000,v1=" + mac + ",v1=" + strings.Repeat("cd", 32), "1700000000", 2},
		{"other schemes are ignored", "t=1700000000,v0=zzz,v1=" + mac, "1700000000", 1},
		{"order does not matter", "v1=" + mac + ",t=1700000000", "1700000000", 1},
	}
	for _, tc := range good {
		t.Run(tc.name, func(t *testing.T) {
			sig, err := parseSignature(tc.header)
			if err != nil {
				t.Fatal(err)
			}
			if sig.ts != tc.ts || len(sig.v1s) != tc.v1s || !sig.at.Equal(time.Unix(1700000000, 0)) {
				t.Fatalf("parsed %+v", sig)
			}
		})
	}

	bad := []struct {
		name, header string
		want         error
	}{
		{"empty", "", ErrNoSignature},
		{"blank", "   ", ErrNoSignature},
		{"no timestamp", "v1=" + mac, ErrMalformedSignature},
		{"no v1", "t=1700000000", ErrMalformedSignature},
		{"only v0", "t=1700000000,v0=" + mac, ErrMalformedSignature},
		{"two timestamps", "t=1700000000,t=1700000001,v1=" + mac, ErrMalformedSignature},
		{"signed timestamp", "t=+1700000000,v1=" + mac, ErrMalformedSignature},
		{"negative timestamp", "t=-5,v1=" + mac, ErrMalformedSignature},
		{"zero timestamp", "t=0,v1=" + mac, ErrMalformedSignature},
		{"timestamp not a number", "t=soon,v1=" + mac, ErrMalformedSignature},
		{"timestamp overflows", "t=99999999999999999999,v1=" + mac, ErrMalformedSignature},
		{"v1 not hex", "t=1700000000,v1=" + strings.Repeat("zz", 32), ErrMalformedSignature},
		{"v1 too short", "t=1700000000,v1=abcd", ErrMalformedSignature},
		{"v1 too long", "t=1700000000,v1=" + mac + "00", ErrMalformedSignature},
		{"empty value", "t=1700000000,v1=", ErrMalformedSignature},
		{"entry without =", "t=1700000000,v1" + mac, ErrMalformedSignature},
		{"trailing comma", "t=1700000000,v1=" + mac + ",", ErrMalformedSignature},
		{"semicolons", "t=1700000000;v1=" + mac, ErrMalformedSignature},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := parseSignature(tc.header); !errors.Is(err, tc.want) {
				t.Fatalf("err %v, want %v", err, tc.want)
			}
		})
	}
}

func TestVerifySignature(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_800_000_000, 0)
	body := []byte(`{"order_id":"o-1","provider_payment_id":"p","status":"succeeded","amount":1}`)
	cases := []struct {
		name   string
		header string
		body   []byte
		want   error
	}{
		{"valid", Sign("s", now, body), body, nil},
		{"edge of tolerance, past", Sign("s", now.Add(-SignatureTolerance), body), body, nil},
		{"edge of tolerance, future", Sign("s", now.Add(SignatureTolerance), body), body, nil},
		{"too old", Sign("s", now.Add(-SignatureTolerance-time.Second), body), body, ErrSignatureExpired},
		{"too far ahead", Sign("s", now.Add(SignatureTolerance+time.Second), body), body, ErrSignatureExpired},
		{"other secret", Sign("t", now, body), body, ErrSignatureMismatch},
		{"other body", Sign("s", now, body), append([]byte(" "), body...), ErrSignatureMismatch},
		{"missing", "", body, ErrNoSignature},
		{"one good v1 of two", Sign("s", now, body) + ",v1=" + strings.Repeat("00", 32), body, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := verifySignature("s", tc.header, tc.body, now); !errors.Is(err, tc.want) {
				t.Fatalf("err %v, want %v", err, tc.want)
			}
		})
	}
}
