package inbox

import "errors"

// ErrPoison marks a failure that retrying cannot cure (a message that does
// not decode, or a handler's [Poison]): the message is dead-lettered at once.
var ErrPoison = errors.New("inbox: poison message")

// ErrConflict marks the dead letter of an event at a sequence its aggregate
// applied under another event id (DeadLetter.ConflictWith).
var ErrConflict = errors.New("inbox: conflicting event at an applied sequence")

// ErrForged marks the dead letter of a message its stream did not take from
// a publisher: the server copied it there from another stream, by a
// stream's republish (a Nats-Stream header) or sources (Nats-Stream-Source).
// A republish ignores the permissions of whoever published the original, so
// whoever may publish to the other stream chose the copy's subject and
// headers: applied, it would be an event no producer of this stream wrote.
var ErrForged = errors.New("inbox: forged message, copied into the stream from another")

// ErrNotFound is returned by the operator functions for an id that no
// unresolved dead letter (or open parked event) has.
var ErrNotFound = errors.New("inbox: dead letter not found")

// Poison wraps err to say that retrying is pointless: the consumer
// dead-letters the message at once. The result matches [ErrPoison] and err.
func Poison(err error) error {
	if err == nil {
		return ErrPoison
	}
	return &poisonError{err: err}
}

type poisonError struct{ err error }

func (e *poisonError) Error() string   { return "poison: " + e.err.Error() }
func (e *poisonError) Unwrap() []error { return []error{ErrPoison, e.err} }
