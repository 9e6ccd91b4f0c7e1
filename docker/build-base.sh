#!/usr/bin/env bash
# Build the node image's base from Debian packages alone (no registry): debootstrap a minimal root filesystem with
# the packages of base-packages.txt and `docker import` it as TAG.
#   bash docker/build-base.sh TAG [SUITE]
# The mirror is the one this machine's apt uses (override with PPHARNESS_DEBIAN_MIRROR). Needs root (or sudo),
# debootstrap and a running Docker daemon. Does nothing when TAG already exists.
set -euo pipefail
TAG=${1:?usage: build-base.sh TAG [SUITE]}
SUITE=${2:-bookworm}
HERE=$(cd "$(dirname "$0")" && pwd)

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
say() { echo "build-base: $*" >&2; }

if docker image inspect "$TAG" >/dev/null 2>&1; then
  say "$TAG exists; nothing to build"
  exit 0
fi

apt_mirror() {
  # The first Debian archive URI of this machine's apt sources (deb822 .sources files, then one-line .list files).
  local uri
  uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' \
        | grep -v -- '-security' | grep '/debian/\?$' | head -n1 || true)
  if [ -z "$uri" ]; then
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '$1 == "deb" {print $2}' \
          | grep -v -- '-security' | grep '/debian/\?$' | head -n1 || true)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR=${PPHARNESS_DEBIAN_MIRROR:-$(apt_mirror)}

if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing debootstrap"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq debootstrap >/dev/null
fi

PACKAGES=$(grep -v '^\s*#' "$HERE/base-packages.txt" | tr -s ' \n' ',' | sed 's/^,//; s/,$//')
ROOTFS=$(mktemp -d "${TMPDIR:-/var/tmp}/ppharness-base.XXXXXX")
trap 'as_root rm -rf "$ROOTFS"' EXIT

say "debootstrap $SUITE from $MIRROR with $PACKAGES (a few minutes on a cold machine)"
start=$(date +%s)
as_root debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" 2>&1 \
  | awk '/^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) / {
           n++; if (n % 100 == 0) { print "build-base:   " $0 " (" n " steps)"; fflush() }; next }
         { print "build-base:   " $0; fflush() }' >&2
say "debootstrap done in $(( $(date +%s) - start )) s"

# apt in the image uses the same mirror; caches and lists are not part of the image
printf 'deb %s %s main\n' "$MIRROR" "$SUITE" | as_root tee "$ROOTFS/etc/apt/sources.list" >/dev/null
as_root rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
  "$ROOTFS"/usr/share/man/* "$ROOTFS"/var/log/*.log "$ROOTFS"/etc/hostname "$ROOTFS"/etc/resolv.conf
as_root touch "$ROOTFS/etc/resolv.conf"

say "importing the root filesystem as $TAG"
as_root tar --numeric-owner --xattrs -C "$ROOTFS" -c . \
  | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
      --change "LABEL ppharness.base=$TAG" - "$TAG" >/dev/null
size=$(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MiB", $1 / 1048576}')
say "$TAG built in $(( $(date +%s) - start )) s ($size)"
