#!/usr/bin/env bash
# Builds the Docker executor's image, tandem-sandbox:latest, with no image registry: a
# Debian bookworm root made by debootstrap from the machine's own apt mirror, then
# `docker import`. It holds Python with numpy, pandas and matplotlib, so a task can analyse
# data and draw charts with the network off, and pip, curl, requests and git for a task
# behind the egress proxy. Idempotent: it returns at once when an image of
# this recipe exists (--force rebuilds).
#
#   scripts/build-sandbox-image.sh [--force] [IMAGE]
#
# Real users can pull python:3.12-slim instead; this is for machines with no registry.
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then force=1; shift; fi
image="${1:-tandem-sandbox:latest}"
suite=bookworm
# Bumped whenever what goes into the image changes, so an older build is replaced.
recipe=5

if ! docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
  echo "error: the Docker engine does not answer (DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}); start it (systemctl start docker) and retry" >&2
  exit 1
fi
built=$(docker image inspect "$image" --format '{{index .Config.Labels "tandem.recipe"}}' 2>/dev/null || true)
if [ "$force" = 0 ] && [ "$built" = "$recipe" ]; then
  echo "$image is already built"
  exit 0
fi

if ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "error: debootstrap is missing; install it (sudo apt-get install debootstrap) and retry" >&2
    exit 1
  fi
  echo "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

# The Debian mirror this machine already uses (deb822 or one-line sources), so no other
# host is needed.
mirror=""
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list; do
  [ -f "$f" ] || continue
  mirror=$(awk '
    /^URIs:/ { for (i = 2; i <= NF; i++) if ($i ~ /\/debian\/?$/) { print $i; exit } }
    /^deb / { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\/.*\/debian\/?$/) { print $i; exit } }
  ' "$f")
  [ -n "$mirror" ] && break
done
if [ -z "$mirror" ]; then
  echo "error: no Debian mirror found in /etc/apt/sources.list*; add the one this machine uses and retry" >&2
  exit 1
fi

root=$(mktemp -d /tmp/tandem-sandbox-root.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap $suite from $mirror into $root"
# python3 (not python3-minimal): code from models imports json, urllib, sqlite3 and the like;
# numpy, pandas and matplotlib are what data questions reach for first; pip, curl, requests,
# git and the CA certificates are what a task behind the egress proxy installs, fetches and
# clones with.
debootstrap --variant=minbase --include=python3,python3-numpy,python3-pandas,python3-matplotlib,python3-pip,python3-requests,git,curl,ca-certificates "$suite" "$root" "$mirror" >"$root.log" 2>&1 || {
  tail -20 "$root.log" >&2
  echo "error: debootstrap failed (log above); check that $mirror is reachable" >&2
  exit 1
}
rm -f "$root.log"
# Smaller and reproducible: no package caches, no apt lists.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
# A sandbox is thrown away with its task: pip may install into it (as the blocks' user, into
# HOME), which Debian's marker for a system-managed Python would refuse.
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
mkdir -p "$root/workspace"
chmod 1777 "$root/workspace"
tar --numeric-owner -C "$root" -c . | docker import \
  --change 'CMD ["/bin/sh"]' \
  --change 'WORKDIR /workspace' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'LABEL org.opencontainers.image.title=tandem-sandbox' \
  --change "LABEL tandem.recipe=$recipe" \
  - "$image" >/dev/null
echo "built $image ($(docker image inspect "$image" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}'))"
