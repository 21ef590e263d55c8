# make demo  — Postgres up, build, run every service in one process
# make test  — Postgres up, the API linters, every test with the race detector,
#              then the suite again with a fifth service in the list
# make chaos — the chaos run for DURATION (default 5m), see README "Chaos run"
# make compose-check — docker-compose.yml run for real, see README "Docker Compose"
.PHONY: build test lint lint-go lint-api bench bench-outbox demo clean chaos trace-check compose-check

# Benchmarks size their own work (a backlog of N events per run), so one
# iteration each is a measurement; raise it for steadier figures.
BENCHTIME ?= 1x

build:
	go build -o bin/shop ./cmd/shop

# The shopbench build tag adds the whole-system suite (proof/benchsuite),
# which no library or binary contains; test and lint build it too so it
# stays correct.
# Tests use TEST_DATABASE_URL, else DATABASE_URL, else the local default;
# each test makes (and drops) its own schema or database there. -p 1 runs
# one package at a time (tests inside a package still run in parallel):
# the end-to-end shop and the many-relays test each hold dozens of
# connections, and together they would pass Postgres's default limit of 100.
# scripts/lift-check.sh then copies pkg/outbox, pkg/inbox and pkg/saga each
# alone into a module of its own and runs its tests there (about a minute,
# up to three on a cold build cache): the libraries must never import the
# shop.
# The second go test is the fork promise: the whole suite again with the
# guide's fifth service (examples/loyalty) in services.All (the
# fifthservice tag), without -race for time: a test that assumes four
# services, their ports or their count fails there. "The whole suite" is
# every package whose test binary the tag changes, which
# scripts/fifth-packages.sh computes (go list -test -deps: the tests that
# reach package services); every other package builds the same binary
# either way.
test: lint-api
	@scripts/ensure-postgres.sh "$${TEST_DATABASE_URL:-}"
	@scripts/ensure-chromium.sh
	go test -race -count=1 -p 1 -tags shopbench -timeout 20m ./...
	go test -count=1 -p 1 -tags fifthservice,shopbench -timeout 25m $$(scripts/fifth-packages.sh)
	go vet -tags tracecheck ./proof/tracecheck
	scripts/lift-check.sh

# make trace-check — a demo order's trace as Jaeger shows it: Jaeger
# v1.75.0 built from its module (tools/jaeger, a module of its own; the
# first build takes about 11 minutes on two cores, later ones a second from
# Go's cache), a shop exporting to it on free ports, an order placed and
# paid, and its trace read from Jaeger's query API: one trace, a publish
# span per event, host attributes, no warning (proof/tracecheck). Not
# part of `make test` for that first build; `make test` checks the same on
# an in-memory exporter.
trace-check:
	@scripts/ensure-postgres.sh "$${TEST_DATABASE_URL:-}"
	jaeger=$$(go -C tools/jaeger tool -n jaeger) && \
	go test -tags tracecheck -count=1 -v -run '^TestJaegerShowsAnOrdersTraceCleanly$$' ./proof/tracecheck -jaeger="$$jaeger"

# make compose-check — the Docker Compose demo as a user runs it, for real
# (scripts/compose-check.sh, as root): the Docker engine and Compose v2
# installed and started if missing, the upstream images built locally when
# absent (deploy/images), `docker compose up --build -d`, the README's
# paste blocks until COMPLETED, the dashboard in a browser and the trace in
# Jaeger, `shop verify`, crashes of the order service and of NATS under
# orders, the same on the cluster profile, the teardown (docs/operating.md,
# "Docker Compose"). About 4 minutes with the images built; the first run
# on a fresh machine builds Compose, Jaeger and the images first, about 34
# minutes on two cores, which .ci/run overlaps with the tests
# (compose-check.sh -prepare).
compose-check:
	scripts/compose-check.sh

# The chaos run: real shop processes (two of each service) on a three-node
# NATS cluster (NODES=1: one node), under SIGKILLs, every failpoint,
# terminated database connections and broker faults (a stream leader
# killed, quorum lost, a process silently partitioned, JetStream disabled
# on a node, a consumer deleted, the cluster restarted), then the
# invariants. A short run (90s of chaos, about two minutes) is part of
# `make test`. CHAOS_LOGS=dir keeps the processes' logs. LANES=partition
# (or process, broker, hostile, comma-separated) runs only those fault
# lanes, to measure one kind of fault's stall with nothing overlapping it.
# LANES=cdc (never by default) runs every relay in ModeCDC on a private
# Postgres cluster of the run's own, killing the relays that stream the
# slots, dropping slots and restarting that Postgres (-m fast, immediate).
DURATION ?= 5m
NODES ?= 3
CHAOS_LOGS ?=
CHAOS_TIMEOUT ?= 1h
LANES ?= process,broker,partition,hostile
chaos:
	@scripts/ensure-postgres.sh "$${TEST_DATABASE_URL:-}"
	go test -count=1 -run '^TestChaos$$' -timeout $(CHAOS_TIMEOUT) -v ./proof/chaos -chaos.duration=$(DURATION) -chaos.nodes=$(NODES) -chaos.logs=$(CHAOS_LOGS) -chaos.lanes=$(LANES)

lint: lint-api lint-go

# lint-go: gofmt and go vet under every build tag (.ci/run runs it before
# make test, which runs lint-api itself).
lint-go:
	@unformatted=$$(gofmt -l .); \
	if [ -n "$$unformatted" ]; then echo "gofmt would change:"; echo "$$unformatted"; exit 1; fi
	go vet ./...
	go vet -tags shopbench ./...
	go vet -tags fifthservice ./...
	go vet -tags tracecheck ./proof/tracecheck

# api/openapi.yaml under redocly's recommended rules (strict: a warning
# fails too; api/redocly.yaml) and spectral's oas ruleset (warnings fail;
# api/.spectral.yaml), with the versions pinned in api/package-lock.json.
# scripts/ensure-node.sh finds (or fetches) a Node new enough; npm ci runs
# again only when the lock file changes.
lint-api: api/node_modules/.installed
	node=$$(scripts/ensure-node.sh) && export PATH="$$node:$$PATH" REDOCLY_TELEMETRY=off && \
	npx --prefix api --no -- redocly lint --config api/redocly.yaml api/openapi.yaml && \
	npx --prefix api --no -- spectral lint --fail-severity=warn --ruleset api/.spectral.yaml api/openapi.yaml

api/node_modules/.installed: api/package.json api/package-lock.json
	node=$$(scripts/ensure-node.sh) && PATH="$$node:$$PATH" npm ci --prefix api --ignore-scripts --no-audit --no-fund
	@touch $@

# make bench — the whole-system table (proof/benchsuite): every row the
# median, min and max of RUNS runs, all in this one invocation; see
# docs/performance.md. BENCH_FLAGS passes -suite.* flags (e.g.
# -suite.saga-seconds=60). `make bench-outbox` runs the outbox package's
# own benchmarks, whose findings docs/performance.md also keeps.
RUNS ?= 3
BENCH_FLAGS ?=
bench:
	@scripts/ensure-postgres.sh "$${TEST_DATABASE_URL:-}"
	go test -tags shopbench -run '^$$' -bench '^BenchmarkSystem$$' -benchtime=1x -timeout 60m ./proof/benchsuite/ -suite.runs=$(RUNS) $(BENCH_FLAGS)

bench-outbox:
	@scripts/ensure-postgres.sh "$${TEST_DATABASE_URL:-}"
	go test -run '^$$' -bench . -benchtime=$(BENCHTIME) -timeout 30m ./pkg/outbox/

demo: build
	@scripts/ensure-postgres.sh
	bin/shop all -demo

clean:
	rm -rf bin data api/node_modules .cache
