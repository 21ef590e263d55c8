#!/usr/bin/env bash
# ensure-postgres.sh [URL]: make the Postgres server that URL names reachable,
# with the settings the CDC relay (RELAY_MODE=cdc) and the test suite need.
#
# URL defaults to $DATABASE_URL, else the contract's default. In order:
#   1. the server answers: go to 5;
#   2. URL names this machine and a local cluster exists: start it and wait;
#   3. running as root with apt-get: install Debian's postgresql, start it,
#      and let the default credentials (postgres/postgres) log in over TCP;
#   4. otherwise say what to do and exit 1.
#   5. The CDC settings: wal_level=logical, max_replication_slots and
#      max_wal_senders at least 64 (a slot and a walsender per service and
#      database: the tests make many), and max_slot_wal_keep_size set (2GB),
#      so that a slot nobody reads any more cannot keep WAL until the disk is
#      full; and max_connections at least 200: a test package runs whole
#      shops side by side (about 60 connections), and a demo shop under
#      `shop loadgen` beside `make test` holds about 36 more, past
#      Postgres's default of 100 ("too many clients", SQLSTATE 53300).
#      When the server is this machine's Debian cluster and we may act
#      (root, or the postgres user), any that is missing is set with ALTER
#      SYSTEM and the cluster restarted (one line says so); otherwise the
#      script says what to set and still succeeds: a relay in ModeCDC then
#      logs the setting it lacks and polls.
# Safe to run again and again, silent when nothing changes; `make demo`,
# `make test` and .ci/run call it. ENSURE_POSTGRES_DRY_RUN=1 prints the
# statements and the restart instead of running them.
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

# The Debian cluster (version and name) that listens on $port; empty when
# there is none or no pg_lsclusters. Its name is main but for a cluster made
# by hand to try this script on (pg_createcluster 15 try -p 5499).
cluster_on_port() {
	command -v pg_lsclusters >/dev/null || return 0
	pg_lsclusters -h | awk -v p="$port" '$3 == p { print $1, $2, $4; exit }'
}

start_local_cluster() {
	local found ver name status
	found=$(cluster_on_port)
	if [[ -z $found ]]; then
		say "no local cluster listens on port $port (see pg_lsclusters); set DATABASE_URL to the right port"
		exit 1
	fi
	read -r ver name status <<<"$found"
	if [[ $status != online* ]]; then
		say "starting local Postgres cluster $ver/$name"
		pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start
	fi
	wait_until_answers
}

is_local() {
	case $host in
	127.0.0.1 | localhost | ::1 | /*) return 0 ;;
	esac
	return 1
}

# as_postgres SQL: run SQL as the cluster's superuser over the local socket
# (peer authentication, no password needed): as root through su, or as the
# postgres user itself. Fails when we are neither.
as_postgres() {
	if [[ $(id -u) == 0 ]]; then
		(cd / && su postgres -s /bin/sh -c "psql -XAtq -p $port -v ON_ERROR_STOP=1 -c \"$1\"")
	elif [[ $(id -un) == postgres ]]; then
		psql -XAtq -p "$port" -v ON_ERROR_STOP=1 -c "$1"
	else
		return 1
	fi
}

# The settings ModeCDC and the tests need, as name=value for ALTER SYSTEM. A
# value the server has that is at least as good is left alone (more slots
# or connections, a smaller or larger but finite max_slot_wal_keep_size).
cdc_settings_sql="SELECT current_setting('wal_level'), current_setting('max_replication_slots'), current_setting('max_wal_senders'), (SELECT setting FROM pg_settings WHERE name = 'max_slot_wal_keep_size'), current_setting('max_connections')"

missing_cdc_settings() { # reads "wal_level|slots|senders|keep_mb|connections"
	local wal slots senders keep conns
	IFS='|' read -r wal slots senders keep conns <<<"$1"
	[[ $wal == logical ]] || echo "wal_level=logical"
	((slots >= 64)) || echo "max_replication_slots=64"
	((senders >= 64)) || echo "max_wal_senders=64"
	[[ $keep != -1 ]] || echo "max_slot_wal_keep_size=2GB"
	((conns >= 200)) || echo "max_connections=200"
}

ensure_cdc_settings() {
	command -v psql >/dev/null || return 0 # nothing to ask the server with
	local found="" ver="" name="" current missing setting value s
	if is_local && [[ -n $(cluster_on_port) ]] && { [[ $(id -u) == 0 ]] || [[ $(id -un) == postgres ]]; }; then
		read -r ver name _ <<<"$(cluster_on_port)"
		found=yes
	fi
	if [[ -n $found ]]; then
		current=$(as_postgres "$cdc_settings_sql") || found=
	fi
	if [[ -z $found ]]; then
		# Not ours to change: read what the URL's user may read, and say.
		current=$(PGCONNECT_TIMEOUT=5 psql "$url" -XAtqc "$cdc_settings_sql" 2>/dev/null) || return 0
	fi
	missing=$(missing_cdc_settings "$current")
	[[ -z $missing ]] && return 0
	if [[ -z $found ]]; then
		say "Postgres at $host:$port lacks the settings RELAY_MODE=cdc needs (relays in cdc mode will poll instead):"
		say "  set $(echo $missing) in postgresql.conf (or ALTER SYSTEM SET ...) and restart the server"
		return 0
	fi
	local stmts=()
	while IFS='=' read -r setting value; do
		stmts+=("ALTER SYSTEM SET $setting = '$value'")
	done <<<"$missing"
	if [[ ${ENSURE_POSTGRES_DRY_RUN:-} == 1 ]]; then
		say "dry run: would set $(echo $missing) on cluster $ver/$name and restart it:"
		printf '  %s;\n' "${stmts[@]}" >&2
		say "  pg_ctlcluster --skip-systemctl-redirect $ver $name restart"
		return 0
	fi
	for s in "${stmts[@]}"; do
		as_postgres "$s" >/dev/null
	done
	say "set $(echo $missing) (what the CDC relay and the tests need); restarting local Postgres cluster $ver/$name"
	pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" restart
	wait_until_answers
}

if answers; then
	ensure_cdc_settings
	exit 0
fi

if ! is_local; then
	say "Postgres at $host:$port does not answer; start it, or point DATABASE_URL at a server that runs"
	exit 1
fi

if local_cluster; then
	start_local_cluster
	allow_default_login
	ensure_cdc_settings
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
	ensure_cdc_settings
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
