package httpx

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// The limits of Bodies: how much of a body a handler left unread the server
// still reads and throws away, and for how long.
const (
	DrainLimit   = 32 << 20
	drainTimeout = 10 * time.Second
)

// Bodies wraps a server's handler so that a client always reads the answer to
// a body that is too large, instead of a reset connection.
//
// Go's server closes a connection whose request left more than 256 KiB
// unread. The client is often still sending then; its next segments reach a
// closed socket, the kernel answers them with RST, and an RST discards the
// 413 that waits unread in the client's receive buffer ("connection reset by
// peer", seen with curl and Go's client alike). Bodies closes that window:
//
//   - a request whose Content-Length already exceeds MaxBody gets the 413
//     before anything is read, so a client that sent "Expect: 100-continue"
//     (curl does for large bodies) never sends the body at all;
//   - after the handler, the response is flushed and whatever the client is
//     still sending is read and discarded, up to DrainLimit bytes within
//     10 s, so it finishes its request, reads the answer, and the
//     connection even stays open for the next request. A body known to be
//     larger than DrainLimit is not read: its connection is closed;
//   - a body sent with "Expect: 100-continue" that was answered without
//     being read is not waited for: the answer says "Connection: close",
//     and whatever the client sends after it is never read as a request;
//   - a body that broke off (its read deadline passed, see LimitBodies, or
//     the client reset) or whose rest did not come within the drain's 10 s
//     ends its connection once the answer is out: the rest, if it ever
//     comes, would be read as the next request, and a client that stalls
//     would otherwise keep the connection for the server's idle timeout.
//
// Bodies needs the server's own ResponseWriter: it is the handler http.Server
// calls, or directly behind LimitBodies, which hands that writer on.
func Bodies(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength == 0 || r.Body == nil || r.Body == http.NoBody {
			next.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		// Reading the rest after the response is written is what full
		// duplex allows; without it the server may refuse the read.
		_ = rc.EnableFullDuplex()
		// The handler reads through a copy of the request: the server's
		// own keeps its own body, whose type the server looks at to decide
		// whether the connection may carry another request (a body closed
		// before its end, an "Expect: 100-continue" body never asked for).
		// Replaced, those checks saw neither, and a client that sent its
		// body after the 413 anyway had the rest read as its next request
		// (431).
		body := &trackedBody{ReadCloser: r.Body}
		inner := r.WithContext(r.Context())
		inner.Body = body
		expectContinue := strings.EqualFold(r.Header.Get("Expect"), "100-continue")

		if r.ContentLength > MaxBody {
			if r.ContentLength > DrainLimit {
				w.Header().Set("Connection", "close")
			}
			WriteProblem(w, r, nil, NewProblem(http.StatusRequestEntityTooLarge, "body-too-large",
				fmt.Sprintf("the request body exceeds %d bytes", MaxBody)))
		} else {
			next.ServeHTTP(w, inner)
		}

		switch {
		case body.eof:
			return
		case body.failed:
			cutOff(rc)
			return
		case expectContinue && !body.read:
			// The client waits for "100 Continue", which it will not get
			// now that the answer is written. It may still send the body
			// (curl does after a second): the server answered with
			// "Connection: close" and closes, so that body is never read
			// as a request.
			return
		case r.ContentLength > DrainLimit:
			return
		}
		_ = rc.Flush()
		_ = rc.SetReadDeadline(time.Now().Add(drainTimeout))
		if _, err := io.CopyN(io.Discard, body, DrainLimit); err != nil && !body.eof {
			cutOff(rc)
		}
	})
}

// cutOff closes the connection of a request whose body broke off, once its
// answer is out. net/http would otherwise keep it for the next request:
// whatever the client sends later would be parsed as one, and a client that
// sends nothing more would hold it until the idle timeout.
func cutOff(rc *http.ResponseController) {
	_ = rc.Flush()
	if conn, _, err := rc.Hijack(); err == nil {
		_ = conn.Close()
	}
}

// trackedBody remembers whether the handler read from the body, whether it
// reached the end, and whether a read failed (a deadline, a reset). A
// handler runs in the server's goroutine for its request, and Bodies reads
// the fields only after it has returned.
type trackedBody struct {
	io.ReadCloser
	read, eof, failed bool
}

func (b *trackedBody) Read(p []byte) (int, error) {
	b.read = true
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == io.EOF:
		b.eof = true
	case err != nil:
		b.failed = true
	}
	return n, err
}
