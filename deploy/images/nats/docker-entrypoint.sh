#!/bin/sh
# The official nats image's entrypoint: flags alone run nats-server.
set -e
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
	set -- nats-server "$@"
fi
exec "$@"
