package broker

import (
	"fmt"
	"maps"
	"reflect"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// FieldDrift is one field of a stream's configuration that differs from
// the shop's: its name in jetstream.StreamConfig, the value the server has
// and the one the shop wants.
type FieldDrift struct {
	Field      string // "RePublish", "AllowRollup", "MaxAge", …
	Have, Want any
}

func (d FieldDrift) String() string {
	return fmt.Sprintf("%s: %s, want %s", d.Field, show(reflect.ValueOf(d.Have)), show(reflect.ValueOf(d.Want)))
}

// Drift compares every field of have, a stream's configuration as the
// server reports it, with want (StreamConfig's) and returns those that
// differ, in the struct's order. Every field: the ones the shop sets, and
// the ones it leaves zero, where a value is what someone else put there —
// RePublish copying the stream into another's subjects, AllowRollup,
// Sources, a Mirror, Sealed, a subject transform, TTLs, counters, atomic
// publishing, and whatever a newer nats.go adds. So it walks the struct
// instead of naming fields, and a field nats-server fills in by itself
// must be set explicitly by StreamConfig (the limits' -1), or the stream
// would show drift for ever (internal/broker's tests create a stream and
// require none).
//
// Two things are not drift: the server's own metadata (keys beginning
// with "_nats.": its version, API level), and nil against empty for a list
// or a map.
func Drift(have, want jetstream.StreamConfig) []FieldDrift {
	have.Metadata, want.Metadata = ownMetadata(have.Metadata), ownMetadata(want.Metadata)
	h, w := reflect.ValueOf(have), reflect.ValueOf(want)
	var drift []FieldDrift
	for i := range h.NumField() {
		hf, wf := h.Field(i), w.Field(i)
		if same(hf, wf) {
			continue
		}
		drift = append(drift, FieldDrift{Field: h.Type().Field(i).Name, Have: hf.Interface(), Want: wf.Interface()})
	}
	return drift
}

// DriftFields are the names of drift's fields, for a log.
func DriftFields(drift []FieldDrift) []string {
	names := make([]string, len(drift))
	for i, d := range drift {
		names[i] = d.Field
	}
	return names
}

// ownMetadata is m without the keys nats-server keeps there itself, nil
// when nothing is left.
func ownMetadata(m map[string]string) map[string]string {
	own := maps.Clone(m)
	maps.DeleteFunc(own, func(k, _ string) bool { return strings.HasPrefix(k, "_nats.") })
	if len(own) == 0 {
		return nil
	}
	return own
}

func same(a, b reflect.Value) bool {
	switch a.Kind() {
	case reflect.Slice, reflect.Map:
		if a.Len() == 0 && b.Len() == 0 {
			return true
		}
	}
	return reflect.DeepEqual(a.Interface(), b.Interface())
}

// show prints a configuration value with what pointers point to: a
// RePublish as {Source:> Destination:orders.x HeadersOnly:false}, not as
// an address.
func show(v reflect.Value) string {
	switch v.Kind() {
	case reflect.Invalid:
		return "none"
	case reflect.Pointer, reflect.Interface:
		if v.IsNil() {
			return "none"
		}
		return show(v.Elem())
	case reflect.Slice:
		if v.Len() == 0 {
			return "[]"
		}
		parts := make([]string, v.Len())
		for i := range v.Len() {
			parts[i] = show(v.Index(i))
		}
		return "[" + strings.Join(parts, " ") + "]"
	}
	if s, ok := v.Interface().(fmt.Stringer); ok {
		return s.String()
	}
	return fmt.Sprintf("%+v", v.Interface())
}
