// Package tracecheck holds the check that an order's trace reads cleanly
// in Jaeger, through Jaeger's own query API: one trace, a publish span per
// event, host attributes on every span, no warning (clock skew or
// otherwise). It needs a Jaeger binary, so it is built only with the
// tracecheck tag: `make trace-check` builds Jaeger from its module
// (tools/jaeger) and runs it; `make lint` vets it with the tag, so that
// it stays correct. `make test` checks the same properties on an in-memory exporter
// (proof/e2e, TestOneOrderIsOneTrace), with Jaeger's clock-skew rule
// ported.
package tracecheck
