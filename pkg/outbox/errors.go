package outbox

import "errors"

// The errors of the package, for errors.Is. Every other error a function
// returns wraps the database's or the broker's, with the event or the step
// it was about.
var (
	// ErrInvalidEvent is returned by Writer.Add and Writer.Queue for an
	// event that cannot be stored (no aggregate, type, payload or subject,
	// a payload that is not JSON, events of one aggregate that mix given
	// and counted sequences); nothing of the call is written.
	ErrInvalidEvent = errors.New("invalid event")
	// ErrNotFound is returned by Get, Requeue and Republish for an event id
	// the outbox does not hold in the state the call needs.
	ErrNotFound = errors.New("outbox event not found")
)
