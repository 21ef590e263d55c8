package httpx

import (
	"errors"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// BodyLimits bounds the request bodies one server reads: how long each may
// take to arrive and how many are read at once. Both are required; the
// shop's values are named in cmd/shop/app (BodyTimeout, MaxReadingBodies).
type BodyLimits struct {
	// Timeout is how long a body may take to arrive, counted from the end
	// of its headers. A client that declares a Content-Length and then
	// trickles or stalls is cut off when it passes.
	Timeout time.Duration
	// Max is how many requests may be reading their bodies at once; the
	// next one is answered 503 without its body being read.
	Max int
	// Logger reports when Max is reached (once each time, not per refusal,
	// so that a flood of slow clients does not flood the log too).
	Logger *slog.Logger
}

func (l BodyLimits) validate() error {
	if l.Timeout <= 0 || l.Max <= 0 || l.Logger == nil {
		return errors.New("httpx: BodyLimits needs a Timeout, a Max and a Logger")
	}
	return nil
}

// LimitBodies wraps a server's handler (Bodies, which it hands the server's
// own ResponseWriter) so that no client can hold the server with a body it
// never finishes: each body must arrive within l.Timeout of its headers, and
// at most l.Max are read at once.
//
// The deadline is the connection's read deadline, set when a request with a
// body is admitted: it counts from the end of the headers, and only requests
// that have a body get one (net/http clears it when the body has ended and
// it starts watching the connection for the client going away). A body that
// does not arrive in time fails the handler's read (ReadBody answers 400
// unreadable-body) and Bodies closes the connection after the answer.
//
// A request over Max is answered 503 overloaded with Retry-After and
// "Connection: close", and its body is not waited for. A slot is held from
// admission until the body has ended (or failed) or the handler has returned,
// whichever is first: a body that arrived whole frees its slot while the
// handler works on it. Requests without a body are never counted.
func LimitBodies(next http.Handler, l BodyLimits) (http.Handler, error) {
	if err := l.validate(); err != nil {
		return nil, err
	}
	return &bodyLimit{next: next, limits: l, slots: make(chan struct{}, l.Max)}, nil
}

// refusalGrace is how long a request refused over BodyLimits.Max may still
// be read from: enough for a body already sent, nothing for a slow one.
const refusalGrace = time.Second

type bodyLimit struct {
	next   http.Handler
	limits BodyLimits
	slots  chan struct{}
	full   atomic.Bool // Max was reached and logged; cleared by the next admission
}

func (b *bodyLimit) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.ContentLength == 0 || r.Body == nil || r.Body == http.NoBody {
		b.next.ServeHTTP(w, r)
		return
	}
	rc := http.NewResponseController(w)
	select {
	case b.slots <- struct{}{}:
		b.full.Store(false)
	default:
		if b.full.CompareAndSwap(false, true) {
			b.limits.Logger.Warn("request bodies at their limit: refusing more with 503 until one ends",
				"limit", b.limits.Max, "remote", r.RemoteAddr)
		}
		// The body is not waited for. net/http reads what has already
		// come of it after the answer (so that closing does not reset the
		// connection under the client's unread 503), within refusalGrace,
		// then closes: a client that is still sending gets no more time.
		_ = rc.SetReadDeadline(time.Now().Add(refusalGrace))
		w.Header().Set("Connection", "close")
		WriteProblem(w, r, b.limits.Logger, NewProblem(http.StatusServiceUnavailable, "overloaded",
			"the server is reading as many request bodies as it will at once; send the request again after Retry-After seconds"))
		return
	}
	body := &slotBody{ReadCloser: r.Body, release: func() { <-b.slots }}
	defer body.end()
	_ = rc.SetReadDeadline(time.Now().Add(b.limits.Timeout))
	// A shallow copy with the counted body: the server keeps the request
	// it made, whose Body it closes and drains itself.
	inner := r.WithContext(r.Context())
	inner.Body = body
	b.next.ServeHTTP(w, inner)
}

// slotBody gives its slot back when the body ends, fails, or its handler
// returns, whichever comes first.
type slotBody struct {
	io.ReadCloser
	release func()
	once    sync.Once
}

func (b *slotBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.end()
	}
	return n, err
}

func (b *slotBody) end() { b.once.Do(b.release) }
