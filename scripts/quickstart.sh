#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to a served volume on the embedded default:
# installs system packages and npm dependencies, builds, creates the volume "work" (10 GiB,
# sparse) in the local store, and serves it on 127.0.0.1:10809 until Ctrl-C.
#   VOLUME=name SIZE=20G LISTEN=127.0.0.1:10809 bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VOLUME="${VOLUME:-work}"
SIZE="${SIZE:-10G}"
LISTEN="${LISTEN:-127.0.0.1:10809}"

if [ "$(id -u)" -eq 0 ]; then bash scripts/install-deps.sh; else echo "quickstart: not root, skipping apt-get (run scripts/install-deps.sh as root for the NBD clients)" >&2; fi
[ -d node_modules ] || npm ci --no-audit --no-fund
npx tsc -p .

B="node dist/cli/bin.cjs"
$B info "$VOLUME" >/dev/null 2>&1 || $B create "$VOLUME" --size "$SIZE"
$B info "$VOLUME"
PORT="${LISTEN##*:}"; HOST="${LISTEN%:*}"
cat >&2 <<MSG

baton is serving volume "$VOLUME" on $LISTEN. In another terminal:
  nbdinfo nbd://$HOST:$PORT/$VOLUME                      # look at it
  nbd-client -N $VOLUME $HOST $PORT /dev/nbd0 && mkfs.ext4 /dev/nbd0   # kernel client (needs the nbd module)
  mkdir -p /tmp/f && nbdfuse /tmp/f nbd://$HOST:$PORT/$VOLUME &       # no nbd module: FUSE + loop
  losetup -f --show /tmp/f/nbd                            # then mkfs.ext4 / mount the loop device
Ctrl-C stops the server after flushing.

MSG
exec $B serve --listen "$LISTEN"
