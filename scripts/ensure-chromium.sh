#!/usr/bin/env bash
# ensure-chromium.sh: make headless Chromium available for the dashboard's
# browser test (ops/dashboard). Does nothing when `chromium` is on PATH;
# as root with apt-get, installs Debian's package; otherwise says what to do
# and exits 1. `make test` and .ci/run call it.
set -euo pipefail

command -v chromium >/dev/null && exit 0

if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
	printf 'ensure-chromium: installing Debian'"'"'s chromium for the dashboard browser test\n' >&2
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
	exit 0
fi

printf '%s\n' \
	"ensure-chromium: the dashboard's browser test needs headless Chromium, and it is not installed." \
	"  Debian/Ubuntu: sudo apt-get install chromium    (then run make test again)" >&2
exit 1
