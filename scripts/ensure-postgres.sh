#!/usr/bin/env bash
# ensure-postgres.sh [URL]: make the Postgres server that URL names reachable.
#
# URL defaults to $DATABASE_URL, else the contract's default. In order:
#   1. the server answers: done, silently;
#   2. URL names this machine and a local cluster exists: start it and wait;
#   3. running as root with apt-get: install Debian's postgresql, start it,
#      and let the default credentials (postgres/postgres) log in over TCP;
#   4. otherwise say what to do and exit 1.
# Safe to run again and again; `make demo`, `make test` and .ci/run call it.
set -euo pipefail

default_url='postgres://postgres:postgres@127.0.0.1:5432/shop?sslmode=disable'
url=${1:-${DATABASE_URL:-$default_url}}

say() { printf 'ensure-postgres: %s\n' "$*" >&2; }

# Split a postgres:// URL into user info, host and port (keyword/value DSNs
# fall back to the defaults, which only matters for the local steps below).
rest=${url#*://}
rest=${rest%%[/?]*}
userinfo=
if [[ $rest == *@* ]]; then
	userinfo=${rest%@*}
	rest=${rest##*@}
fi
host=127.0.0.1
port=5432
if [[ $rest =~ ^\[(.*)\](:([0-9]+))?$ ]]; then # [::1]:5432
	host=${BASH_REMATCH[1]}
	port=${BASH_REMATCH[3]:-5432}
elif [[ -n $rest ]]; then
	host=${rest%%:*}
	[[ $rest == *:* ]] && port=${rest##*:}
fi

answers() {
	if command -v pg_isready >/dev/null; then
		pg_isready -q -h "$host" -p "$port" -t 3
	else # no client tools here (a server in a container, say): a TCP probe
		timeout 3 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null
	fi
}

wait_until_answers() {
	for _ in $(seq 60); do
		answers && return 0
		sleep 0.5
	done
	say "Postgres on $host:$port did not answer within 30s"
	exit 1
}

# A fresh Debian cluster asks for a scram password over TCP and the postgres
# role has none, so the default URL could not log in. Give it the default
# password, only when the URL uses the default credentials.
allow_default_login() {
	[[ $userinfo == postgres:postgres ]] || return 0
	command -v psql >/dev/null || return 0
	local out
	if out=$(PGCONNECT_TIMEOUT=5 psql "$url" -XAtqc 'SELECT 1' 2>&1) ||
		[[ $out == *"does not exist"* ]]; then # logged in; shop creates the database
		return 0
	fi
	if [[ $(id -u) != 0 ]]; then
		say "cannot log in as postgres/postgres: $out"
		say "set DATABASE_URL to credentials that work, or run this script as root"
		exit 1
	fi
	say "setting password 'postgres' for role postgres, so the default DATABASE_URL can log in"
	(cd / && su postgres -s /bin/sh -c "psql -XAtq -p $port -c \"ALTER ROLE postgres PASSWORD 'postgres'\"") >/dev/null
}

local_cluster() {
	compgen -G '/etc/postgresql/*/main' >/dev/null
}

start_local_cluster() {
	local found ver status
	found=$(pg_lsclusters -h | awk -v p="$port" '$2 == "main" && $3 == p { print $1, $4; exit }')
	if [[ -z $found ]]; then
		say "no local cluster listens on port $port (see pg_lsclusters); set DATABASE_URL to the right port"
		exit 1
	fi
	read -r ver status <<<"$found"
	if [[ $status != online* ]]; then
		say "starting local Postgres cluster $ver/main"
		pg_ctlcluster --skip-systemctl-redirect "$ver" main start
	fi
	wait_until_answers
}

if answers; then
	exit 0
fi

case $host in
127.0.0.1 | localhost | ::1 | /*) ;;
*)
	say "Postgres at $host:$port does not answer; start it, or point DATABASE_URL at a server that runs"
	exit 1
	;;
esac

if local_cluster; then
	start_local_cluster
	allow_default_login
	exit 0
fi

if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
	say "installing PostgreSQL with apt-get (once per machine)"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq >/dev/null
	apt-get install -y -qq postgresql >/dev/null
	local_cluster || {
		say "postgresql installed but no cluster under /etc/postgresql; create one with pg_createcluster"
		exit 1
	}
	start_local_cluster
	allow_default_login
	exit 0
fi

say "no Postgres answers at $host:$port, and none can be started here. Do one of:"
if [[ -f "$(dirname "$0")/../docker-compose.yml" ]]; then
	say "  - start the one in docker-compose.yml: docker compose up -d postgres"
fi
say "  - install PostgreSQL (as root: apt-get install postgresql) and run this again"
say "  - point DATABASE_URL (TEST_DATABASE_URL for tests) at a server that runs:"
say "      DATABASE_URL='postgres://user:pass@host:5432/shop?sslmode=disable' make ..."
exit 1
