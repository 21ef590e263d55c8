#!/bin/sh
# Stocks the demo catalogue once: the compose service `seed` runs this in a
# curl image after inventory is healthy. The catalogue is the one that
# `shop all -demo` stocks (demo.Catalogue in internal/demo/demo.go);
# cmd/shop/app/compose_test.go checks that the two agree.
#
# "Once": a SKU the inventory already knows is left alone, so a second
# `docker compose up` does not reset stock that orders have since used.
#
# A restock is an operator's request: when the inventory service has an
# OPERATOR_TOKEN, the same OPERATOR_TOKEN here is sent as a bearer token.
set -eu

INVENTORY_URL=${INVENTORY_URL:-http://inventory:8082}
OPERATOR_TOKEN=${OPERATOR_TOKEN:-}

# restock SKU JSON
restock() {
	if [ -n "$OPERATOR_TOKEN" ]; then
		curl -fsS -o /dev/null -X PUT -H 'Content-Type: application/json' \
			-H "Authorization: Bearer $OPERATOR_TOKEN" -d "$2" "$INVENTORY_URL/stock/$1"
	else
		curl -fsS -o /dev/null -X PUT -H 'Content-Type: application/json' \
			-d "$2" "$INVENTORY_URL/stock/$1"
	fi
}

# seed SKU ON_HAND PRICE (price in cents)
seed() {
	code=$(curl -sS -o /dev/null -w '%{http_code}' "$INVENTORY_URL/stock/$1")
	case $code in
	200)
		echo "$1: already stocked, left alone"
		;;
	404)
		restock "$1" "{\"on_hand\":$2,\"price\":$3}"
		echo "$1: stocked $2 at $3 cents"
		;;
	*)
		echo "$1: GET /stock/$1 answered $code" >&2
		exit 1
		;;
	esac
}

seed SKU-1 100 1999
seed SKU-2 50 1299
seed SKU-3 200 499
