#!/usr/bin/env bash
# make compose-check — the Docker Compose demo run for real, as a user runs
# it (README, "Docker Compose"), on a machine of the development kind, as
# root:
#
#  1. the engine: Debian's docker.io (and debootstrap) with apt-get when
#     missing; dockerd started when none answers, and stopped at the end
#     only when this script started it. Docker Compose v2 (COMPOSE_VERSION)
#     built from its Go module — `go install` refuses it for its exclude
#     directives — and installed as the CLI plugin.
#  2. the upstream images that docker-compose.yml and the Dockerfile name:
#     pulled where their registry answers, else built locally under their
#     own tags (Docker Hub is out of reach here; an image that exists is
#     left alone, so the second run builds none): debian:12-slim by
#     debootstrap, the others from deploy/images/ (its README says how each
#     follows the official image).
#  3. the demo, as the README starts it: `docker compose up --build -d`,
#     every container healthy, the README's paste blocks (place with an
#     Idempotency-Key, pay at WAIT_PAY, watch) until COMPLETED through the
#     published ports; the dashboard in headless Chromium showing the order
#     COMPLETED (proof/pageshot; the screenshot is kept); the order's trace
#     in Jaeger's query API; `shop verify` inside the compose network; a
#     SIGKILL of the order service's and of the NATS server's process, each
#     under two orders (a crash, not `docker kill`, which a restart policy
#     treats as a wanted stop): each comes back by its restart policy and
#     every order completes; the documented teardown,
#     `docker compose --profile cluster down -v`, leaves no container,
#     volume or network of the project, and the build no dangling image but
#     the shop:dev it replaced.
#  4. the cluster profile (three NATS nodes, NATS_REPLICAS=3): every node
#     SIGKILLed in turn under two orders, all complete, `shop verify`, the
#     teardown.
#
# It prints the time from `up` to healthy and to the first COMPLETED order
# and each image's size. On failure the containers' logs are printed and
# everything is torn down all the same.
#
# `compose-check.sh -prepare` does steps 1 and 2 only, and builds the
# shop's image (`docker compose build`), and leaves the dockerd it started
# running for the full check that follows, which stops it (its pid is in
# $dockerd_pidfile). .ci/run prepares so in the background
# while the tests run: on a fresh machine, building Compose, Jaeger and the
# images is most of the check's half hour.
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE_VERSION=v2.40.3
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Compose builds through the engine's BuildKit; without the buildx plugin
# (not on this machine) it would only warn that it cannot use Bake.
export COMPOSE_PROGRESS=${COMPOSE_PROGRESS:-plain} COMPOSE_BAKE=false
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"

start=$(date +%s)
say() { printf 'compose-check [%4ss] %s\n' "$(($(date +%s) - start))" "$*"; }
die() { say "FAIL: $*" >&2; exit 1; }

prepare_only=
case ${1:-} in
-prepare) prepare_only=1 ;;
"") ;;
*) die "usage: compose-check.sh [-prepare]" ;;
esac

work=$(mktemp -d /tmp/compose-check.XXXXXX)
dockerd_pidfile=/run/compose-check-dockerd.pid
dockerd_pid=
project_up=
cleanup() {
	rc=$?
	set +e
	if [ -n "$project_up" ]; then
		if [ "$rc" != 0 ]; then
			say "the containers' state and logs, for the failure above:"
			docker compose --profile cluster ps -a
			docker compose --profile cluster logs --no-color --tail 60
		fi
		docker compose --profile cluster down -v --remove-orphans >/dev/null 2>&1
	fi
	if [ -n "$prepare_only" ] && [ "$rc" = 0 ]; then
		dockerd_pid= # left to the full check, which stops it
	fi
	if [ -n "$dockerd_pid" ]; then
		say "stopping the dockerd compose-check started (pid $dockerd_pid)"
		rm -f "$dockerd_pidfile"
		kill "$dockerd_pid" 2>/dev/null
		for _ in $(seq 30); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
	fi
	rm -rf "$work"
	exit "$rc"
}
trap cleanup EXIT

# --- 1. the engine and Compose ----------------------------------------------
ensure_engine() {
	if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v docker >/dev/null; then
		[ "$(id -u)" = 0 ] || die "no Docker engine (dockerd) or debootstrap, and not root to install them: apt-get install docker.io debootstrap"
		say "installing Debian's docker.io and debootstrap"
		apt-get update -qq
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap iptables >/dev/null
	fi
	if docker info >/dev/null 2>&1; then
		# A dockerd that `compose-check.sh -prepare` started is this run's
		# to stop.
		if [ -z "$prepare_only" ] && [ -f "$dockerd_pidfile" ] && kill -0 "$(cat "$dockerd_pidfile")" 2>/dev/null; then
			dockerd_pid=$(cat "$dockerd_pidfile")
		fi
		return
	fi
	[ "$(id -u)" = 0 ] || die "no Docker engine answers, and not root to start dockerd"
	say "starting dockerd (log: /var/log/compose-check-dockerd.log)"
	dockerd >/var/log/compose-check-dockerd.log 2>&1 &
	dockerd_pid=$!
	echo "$dockerd_pid" >"$dockerd_pidfile"
	for _ in $(seq 60); do
		docker info >/dev/null 2>&1 && return
		kill -0 "$dockerd_pid" 2>/dev/null || die "dockerd exited: $(tail -5 /var/log/compose-check-dockerd.log)"
		sleep 1
	done
	die "dockerd does not answer after 60s: $(tail -5 /var/log/compose-check-dockerd.log)"
}

# modcopy MODULE@VERSION DIR: a writable copy of a module's source, from the
# module proxy (a build inside the read-only module cache cannot write).
modcopy() {
	local dir
	dir=$(cd "$work" && go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
	[ -n "$dir" ] || die "go mod download $1 gave no directory"
	cp -r "$dir" "$2"
	chmod -R u+w "$2"
}

ensure_compose() {
	if docker compose version 2>/dev/null | grep -q "${COMPOSE_VERSION}\$"; then
		return
	fi
	say "building Docker Compose $COMPOSE_VERSION from its module (the first time only)"
	modcopy "github.com/docker/compose/v2@$COMPOSE_VERSION" "$work/compose"
	(cd "$work/compose" && CGO_ENABLED=0 nice -n 10 go build -trimpath \
		-ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
		-o "$work/docker-compose" ./cmd)
	install -D -m 0755 "$work/docker-compose" /usr/local/lib/docker/cli-plugins/docker-compose
	docker compose version | grep -q "${COMPOSE_VERSION}\$" || die "docker compose version: $(docker compose version)"
}

# --- 2. the upstream images -------------------------------------------------
have() { docker image inspect "$1" >/dev/null 2>&1; }

# pull TAG: the real image, where its registry can be reached (here Docker
# Hub cannot: the lookup fails at once, and the image is built instead).
pull() {
	if timeout 600 docker pull -q "$1" >/dev/null 2>&1; then
		say "pulled $1"
		return 0
	fi
	say "$1 cannot be pulled: building it under that tag"
	return 1
}

# image_of SERVICE: the image docker-compose.yml names for a service.
image_of() {
	awk -v s="  $1:" '$0 == s {in_s = 1; next} in_s && /^  [a-z]/ {exit} in_s && $1 == "image:" {print $2; exit}' docker-compose.yml
}

# build TAG CONTEXT [docker build flags]: one image, quietly. With the
# engine's classic builder: the machine's docker CLI wants the buildx plugin
# for BuildKit, and these Dockerfiles need nothing BuildKit adds (Compose
# builds the shop's with BuildKit through the engine API itself).
build() {
	local tag=$1 ctx=$2
	shift 2
	say "building $tag"
	DOCKER_BUILDKIT=0 nice -n 10 docker build -q -t "$tag" "$@" "$ctx" >/dev/null
}

# debian:12-slim: bookworm's minbase by debootstrap, slimmed as the
# official image is (no documentation, man pages or apt lists; the same
# dpkg and apt settings), imported with bash as its command.
build_debian() {
	local tag=$1 rootfs=$work/rootfs
	say "building $tag: debootstrap of bookworm (minbase) from $DEBIAN_MIRROR"
	nice -n 10 debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 ||
		die "debootstrap: $(tail -5 "$work/debootstrap.log")"
	rm -f "$rootfs/etc/apt/sources.list"
	cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<-EOF
		Types: deb
		URIs: http://deb.debian.org/debian
		Suites: bookworm bookworm-updates
		Components: main
		Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

		Types: deb
		URIs: http://deb.debian.org/debian-security
		Suites: bookworm-security
		Components: main
		Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
	EOF
	cp deploy/images/debian/dpkg-docker "$rootfs/etc/dpkg/dpkg.cfg.d/docker"
	cp deploy/images/debian/apt-docker "$rootfs/etc/apt/apt.conf.d/docker"
	# The host's own apt settings (such as a mirror's Valid-Until policy)
	# hold inside its containers too.
	for f in /etc/apt/apt.conf.d/99*; do [ -f "$f" ] && cp "$f" "$rootfs/etc/apt/apt.conf.d/"; done
	rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
		"$rootfs"/var/log/*.log "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/groff/*
	find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} + 2>/dev/null || true
	find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
	find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
	tar -C "$rootfs" --numeric-owner -c . | docker import --change 'CMD ["bash"]' - "$tag" >/dev/null
	rm -rf "$rootfs"
}

# golang:1.26: debian:12-slim, a Go toolchain of the tag's minor version
# (the host's when it is one, else the module proxy's golang.org/toolchain)
# and the machine's extra CA certificates.
build_golang() {
	local tag=$1 want=${1#golang:} ctx=$work/golang goroot version
	version=$(go env GOVERSION)
	case $version in
	go"$want" | go"$want".*) goroot=$(go env GOROOT) ;;
	*)
		version=go$want.0
		goroot=$(cd "$work" && GOTOOLCHAIN=$version go env GOROOT)
		;;
	esac
	mkdir -p "$ctx/certs"
	cp deploy/images/golang/Dockerfile "$ctx/"
	cp -a "$goroot" "$ctx/go"
	for c in /usr/local/share/ca-certificates/*.crt; do [ -f "$c" ] && cp "$c" "$ctx/certs/"; done
	build "$tag" "$ctx" --build-arg "GOLANG_VERSION=${version#go}" --label "shop.compose-check.certs=$(certs_sum)"
	rm -rf "$ctx"
}

# certs_sum: the machine's extra CA certificates, summed: a golang image
# made with others (the machine's egress CA may be new) is made again.
certs_sum() {
	cat /usr/local/share/ca-certificates/*.crt 2>/dev/null | sha256sum | cut -d' ' -f1
}

# nats:<version>-alpine: nats-server built from its own module at the
# version go.mod requires, which the compose file's tag must name.
build_nats() {
	local tag=$1 ctx=$work/nats version
	version=$(go list -m -f '{{.Version}}' github.com/nats-io/nats-server/v2)
	[ "$tag" = "nats:${version#v}-alpine" ] ||
		die "docker-compose.yml runs $tag, go.mod requires nats-server $version: run nats:${version#v}-alpine"
	modcopy "github.com/nats-io/nats-server/v2@$version" "$work/nats-src"
	mkdir -p "$ctx"
	(cd "$work/nats-src" && CGO_ENABLED=0 nice -n 10 go build -trimpath -ldflags "-s -w" -o "$ctx/nats-server" .)
	cp deploy/images/nats/* "$ctx/"
	build "$tag" "$ctx"
	rm -rf "$ctx" "$work/nats-src"
}

# jaegertracing/jaeger:<2.x>: the binary `make trace-check` runs
# (tools/jaeger), with the module's sampling strategies file beside it.
build_jaeger() {
	local tag=$1 ctx=$work/jaeger bin dir
	say "building the Jaeger binary (tools/jaeger; about 11 minutes the first time on two cores)"
	bin=$(nice -n 10 go -C tools/jaeger tool -n jaeger)
	dir=$(go -C tools/jaeger list -m -f '{{.Dir}}' github.com/jaegertracing/jaeger)
	mkdir -p "$ctx"
	cp "$bin" "$ctx/jaeger"
	cp "$dir/cmd/jaeger/sampling-strategies.json" "$ctx/"
	cp deploy/images/jaeger/Dockerfile "$ctx/"
	build "$tag" "$ctx"
	rm -rf "$ctx"
}

ensure_images() {
	local debian golang postgres nats curl jaeger
	golang=$(sed -n 's/^FROM \(golang:[^ ]*\) AS build$/\1/p' Dockerfile)
	debian=$(sed -n 's/^FROM \(debian:[^ ]*\)$/\1/p' Dockerfile)
	postgres=$(image_of postgres)
	nats=$(image_of nats)
	curl=$(image_of seed)
	jaeger=$(image_of jaeger)
	for tag in "$golang" "$debian" "$postgres" "$nats" "$curl" "$jaeger"; do
		[ -n "$tag" ] || die "could not read an image name from the Dockerfile or docker-compose.yml"
	done
	for n in nats-1 nats-2 nats-3; do
		[ "$(image_of $n)" = "$nats" ] || die "service $n runs $(image_of $n), nats runs $nats"
	done
	have "$debian" || pull "$debian" || build_debian "$debian"
	# The official golang image cannot reach the module proxy from a
	# machine whose egress needs extra CA certificates: there ours, with
	# them, is used (and made again when they change).
	if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
		if ! have "$golang" || [ "$(docker image inspect -f '{{index .Config.Labels "shop.compose-check.certs"}}' "$golang")" != "$(certs_sum)" ]; then
			build_golang "$golang"
		fi
	else
		have "$golang" || pull "$golang" || build_golang "$golang"
	fi
	have "$postgres" || pull "$postgres" || build "$postgres" deploy/images/postgres
	have "$nats" || pull "$nats" || build_nats "$nats"
	have "$curl" || pull "$curl" || build "$curl" deploy/images/curl
	have "$jaeger" || pull "$jaeger" || build_jaeger "$jaeger"
	images=("$debian" "$golang" "$postgres" "$nats" "$curl" "$jaeger")
}
# --- 3. the demo, as a user runs it -----------------------------------------
# The services that run for good; migrate and seed run once. The cluster
# profile adds its three NATS nodes.
long_running=(postgres nats jaeger order inventory payment fulfillment dashboard)

# wait_healthy SECONDS: every long-running container healthy, migrate and
# seed exited 0.
wait_healthy() {
	local deadline=$(($(date +%s) + $1)) s state
	while :; do
		local ok=1
		for s in "${long_running[@]}"; do
			state=$(docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' \
				"$(docker compose ps -q "$s")" 2>/dev/null || echo missing)
			[ "$state" = running/healthy ] || ok=0
		done
		for s in migrate seed; do
			state=$(docker compose ps -a --format '{{.State}} {{.ExitCode}}' "$s" 2>/dev/null)
			case $state in "exited 0") ;; "exited "*) die "$s exited: $state" ;; *) ok=0 ;; esac
		done
		[ "$ok" = 1 ] && return
		[ "$(date +%s)" -lt "$deadline" ] || die "not every container healthy after $1s"
		sleep 1
	done
}

# The README's paste blocks (place, pay at WAIT_PAY, watch), as they stand
# in its Quick start (the sh block that sends an Idempotency-Key, the one
# cmd/shop's TestNewcomer pastes too), run against the published ports.
readme_block=$(awk '
	/^## / {qs = ($0 == "## Quick start"); next}
	qs && /^```sh$/ {b = 1; blk = ""; next}
	b && /^```$/ {b = 0; if (blk ~ /Idempotency-Key/) {printf "%s", blk; exit}; next}
	b {blk = blk $0 "\n"}' README.md)
[ -n "$readme_block" ] || die "README.md's Quick start has no sh block that sends an Idempotency-Key"

# order_start NAME: the blocks in the background, their output in
# $work/NAME.out; order_placed NAME: wait until they have placed the order;
# order_wait NAME: the order they placed must end COMPLETED, and its id is
# left in $order.
declare -A order_pid
order_start() {
	bash -c "$readme_block" >"$work/$1.out" 2>&1 &
	order_pid[$1]=$!
}
order_placed() {
	for _ in $(seq 60); do
		grep -q '^order .' "$work/$1.out" && return
		sleep 0.5
	done
	die "the README's first block ($1) placed no order in 30s: $(cat "$work/$1.out")"
}
order_wait() {
	local out
	wait "${order_pid[$1]}" || die "the README's blocks ($1) failed: $(cat "$work/$1.out")"
	out=$(cat "$work/$1.out")
	printf '%s\n' "$out" | sed "s/^/  $1 | /"
	[ "$(printf '%s\n' "$out" | tail -n 1)" = COMPLETED ] || die "order $1 did not end COMPLETED"
	order=$(printf '%s\n' "$out" | sed -n 's/^order \(.*\)$/\1/p' | head -n 1)
}
place_and_complete() { order_start "$1" && order_wait "$1"; }

# crash SERVICE: SIGKILL its process from outside, as a crash would (`docker
# kill` is a wanted stop, which a restart policy honours), and wait for its
# restart policy to bring it back healthy.
crash() {
	local id pid restarts
	id=$(docker compose ps -q "$1")
	pid=$(docker inspect -f '{{.State.Pid}}' "$id")
	restarts=$(docker inspect -f '{{.RestartCount}}' "$id")
	say "SIGKILL to $1's process (pid $pid on the host)"
	kill -KILL "$pid"
	for _ in $(seq 120); do
		if [ "$(docker inspect -f '{{.RestartCount}}' "$id")" -gt "$restarts" ] &&
			[ "$(docker inspect -f '{{.State.Health.Status}}' "$id")" = healthy ]; then
			say "$1 restarted by its policy and is healthy again"
			return
		fi
		sleep 1
	done
	die "$1 did not come back healthy within 120s of its SIGKILL"
}

# crash_under_orders SERVICE...: two orders placed through the README's
# blocks while each SERVICE in turn is killed; both must complete.
crash_under_orders() {
	local s
	for s in "$@"; do
		order_start "before-$s"
		order_placed "before-$s"
		crash "$s"
		order_start "after-$s"
		order_wait "before-$s"
		order_wait "after-$s"
	done
}

# verify_shop [ENV...]: `shop verify` inside the compose network.
verify_shop() {
	say "shop verify, inside the compose network"
	docker compose run --rm --no-deps -e NATS_URL="${NATS_URL:-nats://nats:4222}" \
		-e AUDIT_NATS_PASSWORD="${AUDIT_NATS_PASSWORD:-audit-demo-password}" migrate verify -wait 30s 2>&1 | sed 's/^/  | /' ||
		die "shop verify failed"
}

# dashboard_shows ORDER: the dashboard's page, rendered by headless
# Chromium as a visitor's browser renders it (proof/pageshot), shows the
# order's card, COMPLETED; its screenshot is kept in $out_dir.
dashboard_shows() {
	local url="http://127.0.0.1:${SHOP_DASHBOARD_PORT:-8080}/"
	go build -o "$work/pageshot" ./proof/pageshot
	"$work/pageshot" -url "$url" -out "$out_dir/dashboard.png" \
		-wait "li.card[data-order-id=\"$1\"][data-status=\"COMPLETED\"]" ||
		die "the dashboard at $url does not show order $1 COMPLETED"
	say "the dashboard shows order $1 COMPLETED (screenshot: $out_dir/dashboard.png)"
}

# jaeger_has_trace ORDER: the order's trace, found by its shop.order_id tag
# as a user searches Jaeger's UI, read from Jaeger's query API inside the
# compose network; every service of the saga has spans in it.
jaeger_has_trace() {
	local q body s
	q="service=shop-order&lookback=1h&limit=5&tags=%7B%22shop.order_id%22%3A%22$1%22%7D"
	for _ in $(seq 30); do
		body=$(docker compose run --rm --no-deps -T --entrypoint curl seed -fsS "http://jaeger:16686/api/traces?$q" 2>/dev/null || true)
		local missing=
		for s in order inventory payment fulfillment; do
			printf '%s' "$body" | grep -q "\"serviceName\":\"shop-$s\"" || missing="$missing $s"
		done
		if [ -z "$missing" ]; then
			say "Jaeger has order $1's trace, with spans of order, inventory, payment and fulfillment"
			return
		fi
		sleep 1
	done
	die "Jaeger's query API has no trace of order $1 with spans of every service (missing:$missing)"
}

# down_leaves_nothing: the documented teardown leaves no container, volume
# or network of the project.
down_leaves_nothing() {
	local left
	say "docker compose --profile cluster down -v"
	docker compose --profile cluster down -v 2>&1 | sed 's/^/  | /'
	project_up=
	left=$(docker ps -a -q --filter "label=com.docker.compose.project=$project")
	[ -z "$left" ] || die "containers left after down -v: $left"
	left=$(docker volume ls -q --filter "label=com.docker.compose.project=$project")
	[ -z "$left" ] || die "volumes left after down -v: $left"
	left=$(docker network ls -q --filter "label=com.docker.compose.project=$project")
	[ -z "$left" ] || die "networks left after down -v: $left"
}

ensure_engine
scripts/ensure-chromium.sh # the dashboard's screenshot
ensure_compose
ensure_images
if [ -n "$prepare_only" ]; then
	# The shop's image too, as `up --build` builds it (the compose file's
	# own build): the check's `up --build` then finds its layers built.
	say "docker compose build"
	docker compose build 2>&1 | sed 's/^/  | /'
	say "prepared: the engine, Compose $COMPOSE_VERSION, the images ${images[*]} and shop:dev"
	exit 0
fi
out_dir=${COMPOSE_CHECK_OUT:-/tmp/compose-check-out}
mkdir -p "$out_dir"

project=$(docker compose config --format json | sed -n 's/^  "name": "\(.*\)",$/\1/p' | head -n 1)
[ -n "$project" ] || die "docker compose config names no project"
if [ -n "$(docker compose --profile cluster ps -a -q)" ]; then
	die "project $project already has containers: stop them first (docker compose --profile cluster down)"
fi
old_shop=$(docker image inspect -f '{{.Id}}' shop:dev 2>/dev/null || true)
dangling_before=$(docker images -q --no-trunc -f dangling=true | sort)

# The demo as the README starts it: one NATS server.
say "docker compose up --build -d (project $project)"
up=$(date +%s)
project_up=1
docker compose up --build -d 2>&1 | sed 's/^/  | /'
built=$(date +%s)
wait_healthy 300
healthy=$(date +%s)
say "every container healthy, $((healthy - up))s after up (the build took $((built - up))s)"

say "the README's paste blocks: place, pay, watch"
place_and_complete first
completed=$(date +%s)
say "first order COMPLETED $((completed - up))s after up"
dashboard_shows "$order"
jaeger_has_trace "$order"
verify_shop
crash_under_orders order nats
verify_shop
down_leaves_nothing

# One build of shop:dev, not one per service: the only new dangling image
# may be the shop:dev that this build replaced, which is removed.
new_dangling=$(comm -13 <(printf '%s\n' "$dangling_before") <(docker images -q --no-trunc -f dangling=true | sort) | grep -v -x -F "${old_shop:-none}" || true)
[ -z "$new_dangling" ] || die "the build left dangling images: $new_dangling"
if [ -n "$old_shop" ] && [ "$old_shop" != "$(docker image inspect -f '{{.Id}}' shop:dev)" ]; then
	docker image rm "$old_shop" >/dev/null 2>&1 || true
fi

# The cluster profile as docker-compose.yml's header starts it: the
# services on three NATS nodes, every stream R3; each node in turn crashes
# under two orders.
say "the cluster profile: three NATS nodes, NATS_REPLICAS=3"
export NATS_URL=nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222 NATS_REPLICAS=3
cluster_up=$(date +%s)
project_up=1
docker compose --profile cluster up -d 2>&1 | sed 's/^/  | /'
long_running+=(nats-1 nats-2 nats-3)
wait_healthy 300
say "every container healthy, $(($(date +%s) - cluster_up))s after up"
place_and_complete cluster
say "first order COMPLETED $(($(date +%s) - cluster_up))s after up"
crash_under_orders nats-1 nats-2 nats-3
verify_shop
down_leaves_nothing
unset NATS_URL NATS_REPLICAS

say "image sizes:"
for tag in "${images[@]}" shop:dev; do
	printf '  %-40s %s\n' "$tag" "$(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
done
say "ok: healthy $((healthy - up))s and first order COMPLETED $((completed - up))s after up; whole check $(($(date +%s) - start))s"
