#!/usr/bin/env bash
# The official postgres image's entrypoint, in short: as root, own PGDATA
# and drop to postgres; on an empty PGDATA, initdb with POSTGRES_USER's
# POSTGRES_PASSWORD, allow password logins from anywhere
# (POSTGRES_HOST_AUTH_METHOD, default scram-sha-256), create POSTGRES_DB,
# run /docker-entrypoint-initdb.d; then exec the server.
set -Eeo pipefail

if [ "${1:0:1}" = '-' ]; then
	set -- postgres "$@"
fi

if [ "$1" = 'postgres' ]; then
	if [ "$(id -u)" = '0' ]; then
		mkdir -p "$PGDATA" /var/run/postgresql
		chown postgres:postgres "$PGDATA" /var/run/postgresql
		chmod 00700 "$PGDATA"
		chmod 3777 /var/run/postgresql
		exec setpriv --reuid=postgres --regid=postgres --init-groups "${BASH_SOURCE[0]}" "$@"
	fi
	if [ ! -s "$PGDATA/PG_VERSION" ]; then
		: "${POSTGRES_USER:=postgres}"
		: "${POSTGRES_DB:=$POSTGRES_USER}"
		auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
		if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
			echo 'Error: Database is uninitialized and superuser password is not specified.' >&2
			echo '       Set POSTGRES_PASSWORD (or POSTGRES_HOST_AUTH_METHOD=trust).' >&2
			exit 1
		fi
		pwfile=$(mktemp)
		printf '%s\n' "${POSTGRES_PASSWORD:-}" >"$pwfile"
		# shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS is a list of flags
		initdb --username="$POSTGRES_USER" --pwfile="$pwfile" -D "$PGDATA" ${POSTGRES_INITDB_ARGS:-}
		rm -f "$pwfile"
		printf '\nhost all all all %s\n' "$auth" >>"$PGDATA/pg_hba.conf"
		# A server on the socket only, as the official entrypoint runs
		# its init scripts, so that no client sees it half set up.
		pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -p 5432" -w start
		if [ "$POSTGRES_DB" != postgres ]; then
			psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --no-password --dbname postgres \
				-c "CREATE DATABASE \"$POSTGRES_DB\""
		fi
		for f in /docker-entrypoint-initdb.d/*; do
			# shellcheck disable=SC1090 # the image user's own init scripts
			case $f in
			*.sh) echo "running $f"; . "$f" ;;
			*.sql) echo "running $f"; psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --no-password --dbname "$POSTGRES_DB" -f "$f" ;;
			esac
		done
		pg_ctl -D "$PGDATA" -m fast -w stop
		echo 'PostgreSQL init process complete; ready for start up.'
	fi
fi

exec "$@"
