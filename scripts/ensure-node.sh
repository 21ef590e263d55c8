#!/usr/bin/env bash
# ensure-node.sh: make a Node.js that can run the API linters (api/package.json:
# redocly needs Node >= 20.19) available, and print the directory holding its
# node and npm, for the caller to put first on PATH. Uses the node on PATH
# when it is new enough. Otherwise (Debian bookworm's nodejs is 18) it
# installs Debian's nodejs and npm as root with apt-get if npm is missing,
# and uses that npm to fetch the pinned Node build the npm registry serves
# (node-linux-<arch>) into .cache/node. `make lint-api` (part of make lint
# and make test) calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

NODE_VERSION=22.23.5 # the fallback's version; any Node >= 20.19 will do
cache=$PWD/.cache/node

new_enough() { # node binary
	"$1" -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=19)?0:1)' 2>/dev/null
}

if command -v node >/dev/null && command -v npm >/dev/null && new_enough node; then
	dirname "$(command -v node)"
	exit 0
fi
bin=$cache/node_modules/node-linux-$(uname -m | sed 's/x86_64/x64/; s/aarch64/arm64/')/bin
if [[ -x $bin/node ]] && new_enough "$bin/node"; then
	echo "$bin"
	exit 0
fi

if ! command -v npm >/dev/null; then
	if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
		printf 'ensure-node: installing Debian'"'"'s nodejs and npm for the API linters\n' >&2
		apt-get update -qq
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
	else
		printf '%s\n' \
			"ensure-node: the API linters (make lint-api) need Node.js >= 20.19 with npm, and npm is not installed." \
			"  Debian/Ubuntu: sudo apt-get install nodejs npm    (then run make again)" >&2
		exit 1
	fi
fi
if new_enough node; then
	dirname "$(command -v node)"
	exit 0
fi
printf 'ensure-node: node %s is too old for redocly; fetching Node %s from the npm registry into .cache/node\n' "$(node --version)" "$NODE_VERSION" >&2
npm install --silent --no-audit --no-fund --no-save --prefix "$cache" "node-linux-$(uname -m | sed 's/x86_64/x64/; s/aarch64/arm64/')@$NODE_VERSION" >&2
new_enough "$bin/node" || { echo "ensure-node: $bin/node does not run" >&2; exit 1; }
echo "$bin"
