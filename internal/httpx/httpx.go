// Package httpx holds the HTTP edge every service shares: strict JSON request
// decoding with the contract's status codes, RFC 9457 problem responses, and
// WaitReady for whoever starts the services and must wait for them.
package httpx

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/shop-ref/shop/internal/database"
)

// MaxBody is the largest request body accepted (the contract's 64 KiB).
const MaxBody = 64 << 10

// Problem is an RFC 9457 problem. Type is stable: clients match on it.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	Code   string `json:"code"`

	// RetryAfter, when set, is sent as the Retry-After header (in whole
	// seconds): how long the client should wait before sending the same
	// request again. Every 503 carries one (DefaultRetryAfter if unset).
	RetryAfter time.Duration `json:"-"`
}

// DefaultRetryAfter is the Retry-After of a 503 that names none.
const DefaultRetryAfter = time.Second

func (p *Problem) Error() string {
	if p.Detail != "" {
		return p.Code + ": " + p.Detail
	}
	return p.Code
}

// NewProblem returns a problem with status and a stable code; the type URI
// is derived from the code.
func NewProblem(status int, code, detail string) *Problem {
	return &Problem{
		Type:   "https://shop.example/problems/" + code,
		Title:  http.StatusText(status),
		Status: status,
		Detail: detail,
		Code:   code,
	}
}

// WithRetryAfter sets p's RetryAfter and returns p, for building a problem
// in one expression.
func (p *Problem) WithRetryAfter(d time.Duration) *Problem {
	p.RetryAfter = d
	return p
}

// Invalid is a 422: well-formed but not acceptable input.
func Invalid(format string, args ...any) *Problem {
	return NewProblem(http.StatusUnprocessableEntity, "invalid-request", fmt.Sprintf(format, args...))
}

// Unavailable is the 503 of a request whose database failed under it: it
// was unreachable, refused the connection, or dropped it mid-request — at
// worst during COMMIT, so that whether the write took effect is unknown.
// Retrying is safe because every write is idempotent: POST /orders by its
// Idempotency-Key, the webhook by the provider's payment id, PUT /stock
// and cancel by being absolute.
func Unavailable() *Problem {
	return NewProblem(http.StatusServiceUnavailable, "dependency-unavailable",
		"the database did not answer, so the request may or may not have taken effect; "+
			"send it again after Retry-After seconds (POST /orders: with the same Idempotency-Key, "+
			"which returns the order if the first attempt created it)").WithRetryAfter(DefaultRetryAfter)
}

// WriteProblem writes err as a problem response: a *Problem as it is; an
// error database.Transient accepts (Postgres unreachable or the connection
// lost, the commit's outcome unknown with it) as the 503 of Unavailable;
// any other error as a 500 whose detail is not shown. Both are logged.
func WriteProblem(w http.ResponseWriter, r *http.Request, log *slog.Logger, err error) {
	var p *Problem
	switch {
	case errors.As(err, &p):
	case database.Transient(err):
		log.Warn("request failed: the database did not answer", "method", r.Method, "path", r.URL.Path, "err", err)
		p = Unavailable()
	default:
		log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
		p = NewProblem(http.StatusInternalServerError, "internal", "")
	}
	if p.RetryAfter > 0 || p.Status == http.StatusServiceUnavailable {
		SetRetryAfter(w, p.RetryAfter)
	}
	write(w, p.Status, "application/problem+json", p)
}

// SetRetryAfter sets the Retry-After header to d in whole seconds, rounded
// up, at least one (DefaultRetryAfter when d is 0).
func SetRetryAfter(w http.ResponseWriter, d time.Duration) {
	secs := max(int64((cmp.Or(d, DefaultRetryAfter)+time.Second-1)/time.Second), 1)
	w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
}

// WriteJSON writes v with status.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	write(w, status, "application/json", v)
}

// write sends v as a complete response with its Content-Length, so that a
// client reads where it ends even while its own request is still being
// discarded (see Bodies), instead of waiting for a chunked body to end.
func write(w http.ResponseWriter, status int, contentType string, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		status, body = http.StatusInternalServerError, []byte(`{"error":"response not encodable"}`)
	}
	body = append(body, '\n')
	w.Header().Set("Content-Type", contentType)
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// Decode reads r's body into dst, strictly: a JSON content type (415
// otherwise), at most MaxBody bytes (413), one JSON value with no unknown
// fields and the right types (400). It returns the raw body too, for
// request hashing and signatures.
func Decode(r *http.Request, dst any) ([]byte, error) {
	if err := RequireJSON(r); err != nil {
		return nil, err
	}
	body, err := ReadBody(r)
	if err != nil {
		return nil, err
	}
	return body, DecodeBytes(body, dst)
}

// ReadBody reads at most MaxBody bytes of r's body (413 beyond).
func ReadBody(r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxBody+1))
	if err != nil {
		return nil, NewProblem(http.StatusBadRequest, "unreadable-body", "the request body could not be read")
	}
	if len(body) > MaxBody {
		return nil, NewProblem(http.StatusRequestEntityTooLarge, "body-too-large",
			fmt.Sprintf("the request body exceeds %d bytes", MaxBody))
	}
	return body, nil
}

// DecodeBytes decodes one JSON value from body into dst, refusing unknown
// fields, wrong types and trailing data with a 400.
func DecodeBytes(body []byte, dst any) error {
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return NewProblem(http.StatusBadRequest, "malformed-json", describe(err))
	}
	if dec.More() {
		return NewProblem(http.StatusBadRequest, "malformed-json", "the body holds more than one JSON value")
	}
	if _, err := dec.Token(); err != io.EOF {
		return NewProblem(http.StatusBadRequest, "malformed-json", "unexpected data after the JSON value")
	}
	return nil
}

// RequireJSON refuses a request whose Content-Type is not JSON with a 415.
// Decode applies it; a handler that must read the raw body first (a signed
// webhook) calls it itself.
func RequireJSON(r *http.Request) error {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || (mt != "application/json" && !strings.HasSuffix(mt, "+json")) {
		return NewProblem(http.StatusUnsupportedMediaType, "unsupported-media-type",
			"send the body as application/json")
	}
	return nil
}

func describe(err error) string {
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syntax):
		return fmt.Sprintf("malformed JSON at byte %d", syntax.Offset)
	case errors.As(err, &typ):
		return fmt.Sprintf("field %q must be %s", typ.Field, typ.Type)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "the body is empty or cut short"
	case strings.HasPrefix(err.Error(), "json: unknown field"):
		return strings.TrimPrefix(err.Error(), "json: ")
	}
	return "the body is not valid JSON for this request"
}
