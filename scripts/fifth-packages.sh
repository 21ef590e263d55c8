#!/usr/bin/env bash
# scripts/fifth-packages.sh — the packages whose test binaries change when
# the fifthservice tag puts examples/loyalty in services.All: every package
# whose tests import github.com/shop-ref/shop/services, directly or not.
# `make test` runs them a second time with the tag. A package outside this
# list builds the same test binary with or without the tag (the tag's only
# files are services/example_on.go and example_off.go), so running it again
# would test nothing new; the list is computed, never written down, so a
# new test that reaches the service list joins the second run by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
tags=${1:-fifthservice,shopbench}
# Each package's own tests and its external _test package are listed with
# ForTest set to the package under test.
go list -tags "$tags" -test -f '{{if .ForTest}}{{.ForTest}} {{join .Deps " "}}{{end}}' ./... |
	awk '{for (i = 2; i <= NF; i++) if ($i == "github.com/shop-ref/shop/services") {print $1; break}}' |
	sort -u
