package journey

import "strings"

// typeOfSubject is the event type a subject names: its last token.
func typeOfSubject(subject string) string {
	return subject[strings.LastIndexByte(subject, '.')+1:]
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// oneLine keeps an error message to one line of reasonable length.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > 200 {
		s = string(r[:199]) + "…"
	}
	return s
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
