#!/usr/bin/env bash
# lift-check.sh [lib...]: prove that pkg/outbox, pkg/inbox and pkg/saga (or
# the libs named) can be lifted whole, as their doc comments promise.
#
# For each library it copies pkg/<lib> alone (with its migrations/), and the
# libraries' shared test environment pkg/internal/testenv as the copy's own
# internal/testenv, into a temporary directory as a new module,
# example.com/lifted/<lib>, rewrites the library's own import paths there,
# and runs `go test` in it: the library must build and pass its tests
# against the real Postgres and an embedded nats-server with nothing of the
# shop. It fails when a copy still imports anything from the shop.
#
# Offline-friendly: the new module takes this repository's go.mod
# requirements and go.sum as they are (the same versions; no `go mod tidy`,
# which would fetch the test dependencies of every dependency), so with the
# module cache warm from building the shop nothing is downloaded. It prints
# the modules each library and its tests import from. Tests run without -race, once (make test runs
# the libraries with -race in place); drill tests are skipped (-short).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
libs=("$@")
[ ${#libs[@]} -gt 0 ] || libs=(outbox inbox saga)
shop=github.com/shop-ref/shop

say() { printf 'lift-check: %s\n' "$*" >&2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GOFLAGS=-mod=mod

for lib in "${libs[@]}"; do
	start=$(date +%s)
	mod=example.com/lifted/$lib
	dir=$work/$lib
	cp -R "$root/pkg/$lib" "$dir"
	mkdir -p "$dir/internal"
	cp -R "$root/pkg/internal/testenv" "$dir/internal/testenv"
	# The library's own path becomes the new module's, imports and tracer
	# names alike, and so does the test environment's; any other mention
	# of the shop in Go code is a failure.
	find "$dir" -name '*.go' -exec sed -i "s#$shop/pkg/$lib\\b#$mod#g; s#$shop/pkg/internal/testenv\\b#$mod/internal/testenv#g" {} +
	if leftover=$(grep -rn --include='*.go' "\"$shop" "$dir"); then
		say "pkg/$lib, copied alone, still imports the shop:"
		printf '%s\n' "${leftover//$dir/pkg\/$lib}" >&2
		exit 1
	fi
	{
		printf 'module %s\n\n' "$mod"
		sed -n '/^go /p; /^require/,$p' "$root/go.mod"
	} >"$dir/go.mod"
	cp "$root/go.sum" "$dir/go.sum"
	if (cd "$dir" && go list -deps -test ./... | grep -q "^$shop"); then
		say "pkg/$lib, copied alone, depends on the shop"
		exit 1
	fi
	(cd "$dir" && go test -count=1 -short ./...)
	uses=$(cd "$dir" && go list -f '{{join .Imports "\n"}}{{"\n"}}{{join .TestImports "\n"}}{{"\n"}}{{join .XTestImports "\n"}}' ./... |
		sort -u | grep '\.' | grep -v "^$mod" | xargs go list -f '{{with .Module}}{{.Path}}@{{.Version}}{{end}}' | sort -u | tr '\n' ' ')
	say "pkg/$lib lifted alone: ok in $(($(date +%s) - start))s; it imports from $uses"
done
