# The one image of the shop: the static `shop` binary on a minimal Debian, run
# as a non-root user. Every service, `shop migrate` and `shop all` run from it:
#
#   docker build -t shop:dev .
#   docker run --rm shop:dev -h
#   docker compose up            (see docker-compose.yml)
#
# cmd/shop/app/compose_test.go checks this file against the code (Go version,
# build flags, entrypoint, user, ports) and builds the binary the same way.
#
# No `# syntax=` line: it would make BuildKit fetch a frontend image from
# Docker Hub at every build, and the frontend built into BuildKit (Docker
# 20.10 and later) already has all this file uses, RUN --mount=type=cache
# included; so the build needs no registry but Debian's and Go's.

# --- build -------------------------------------------------------------------
# The Go version matches the go directive of go.mod.
FROM golang:1.26 AS build
WORKDIR /src
# Modules first, so that a change to the code does not download them again.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod \
    go mod download
COPY . .
# CGO_ENABLED=0: a static binary that needs no libc from the final image.
# -trimpath: no paths of the build machine in the binary or its stack traces.
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/shop ./cmd/shop

# --- run ---------------------------------------------------------------------
# debian:12-slim rather than distroless: the compose health checks call
# GET /readyz from inside the container, which needs an HTTP client (curl),
# and the shop has no health-probe subcommand of its own. curl costs a few
# megabytes; ca-certificates lets the shop reach a TLS Postgres or NATS.
FROM debian:12-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 shop \
 && useradd --system --uid 10001 --gid shop --home-dir /var/lib/shop --create-home --shell /usr/sbin/nologin shop
COPY --from=build /out/shop /shop
# `shop all` keeps its embedded NATS server's streams under ./data/nats, so
# the working directory is the non-root user's own, writable home.
WORKDIR /var/lib/shop
USER 10001:10001
# The dashboard (DASHBOARD_ADDR, :8080) and the services' default addresses
# (<SERVICE>_ADDR: order :8081 … fulfillment :8084), with room for a fork's
# own services (docs/adding-a-service.md).
EXPOSE 8080-8089
ENTRYPOINT ["/shop"]
CMD ["-h"]
