#!/usr/bin/env bash
# The one test command (README, .ci/run): build, run every ava test file with TAP output,
# and end with "N passed, N failed". Tests start their own servers (nbd, Redis, radosgw).
set -uo pipefail
cd "$(dirname "$0")/.."
npx tsc -p . || { echo "0 passed, 1 failed"; exit 1; }
TAP="$(mktemp)"
trap 'rm -f "$TAP"' EXIT
npx ava --tap "$@" | tee "$TAP"
rc=${PIPESTATUS[0]}
awk '/^# pass/{p=$3} /^# fail/{f=$3} /^# skip/{s=$3} END{ if (s>0) printf "%d passed, %d failed, %d skipped\n", p, f, s; else printf "%d passed, %d failed\n", p, f }' "$TAP"
exit "$rc"
