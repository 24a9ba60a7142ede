#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build, test and benchmark baton.
# Idempotent: packages already present are skipped by apt-get; run as root.
set -euo pipefail

PKGS=(
  # real NBD clients and the reference server
  nbd-client libnbd-bin python3-libnbd nbdkit qemu-utils fio fuse3 e2fsprogs
  # TLS tests: certtool and psktool (the README recipe; openssl makes the other test certificates)
  gnutls-bin openssl
  # the kernel-client VM (see test/vm/)
  qemu-system-x86 busybox-static socat cpio xz-utils
  # Redis for the lease, Ceph radosgw for a real S3 API
  redis-server radosgw ceph-mon ceph-osd ceph-common uuid-runtime
  # tools used by the ext4 end-to-end tests
  git iproute2 util-linux procps
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "install-deps: system packages ready" >&2
