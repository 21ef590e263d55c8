package inbox

import "errors"

// ErrPoison marks a failure that will not go away by retrying: a message
// that cannot be decoded, or one a handler declared hopeless with [Poison].
// The consumer dead-letters such a message at once instead of spending
// MaxDeliver attempts on it. Test for it with errors.Is.
var ErrPoison = errors.New("inbox: poison message")

// ErrConflict marks a dead letter of an event that arrived at a sequence
// its aggregate had already applied under another event id: two different
// events claim one place in the aggregate's history. Neither is dropped as
// a duplicate; an operator decides (see DeadLetter.ConflictWith).
var ErrConflict = errors.New("inbox: conflicting event at an applied sequence")

// ErrNotFound is returned by [RequeueDeadLetter] when no unresolved dead
// letter has the given id.
var ErrNotFound = errors.New("inbox: dead letter not found")

// Poison wraps err to say that processing the message failed
// deterministically (a payload the handler cannot parse, a schema version
// it does not know), so retrying is pointless. A handler returns it; the
// consumer rolls the transaction back and dead-letters the message at once.
// The result matches both [ErrPoison] and err under errors.Is and errors.As.
func Poison(err error) error {
	if err == nil {
		return ErrPoison
	}
	return &poisonError{err: err}
}

type poisonError struct{ err error }

func (e *poisonError) Error() string   { return "poison: " + e.err.Error() }
func (e *poisonError) Unwrap() []error { return []error{ErrPoison, e.err} }
