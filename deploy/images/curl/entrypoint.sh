#!/bin/sh
# The official curl image's entrypoint: flags alone run curl.
set -e
if [ "${1#-}" != "$1" ]; then
	set -- curl "$@"
fi
exec "$@"
