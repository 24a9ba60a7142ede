#!/usr/bin/env bash
# The simulator's revert table: for each fix, put the code back as it was before the fix
# (ITEM.patch, a minimal revert of the one mechanism), build that tree apart, and run seeds
# 1, 2, ... until the simulator fails; print the first failing seed, its check and the time.
# A simulator that finds no reverted fix finds nothing: this is its proof of power.
#
#   bash test/sim/reverts/run.sh                 # every patch here, up to 3000 seeds each
#   bash test/sim/reverts/run.sh 9.1 9.7         # some
#   MAX_SEEDS=500 JOBS=2 bash test/sim/reverts/run.sh
#
# Each patch applies to the commit it was made on; one that no longer applies is reported as
# such (make it again against the current code: it is the fix, undone).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
max="${MAX_SEEDS:-3000}"
jobs="${JOBS:-2}"
items=("$@")
if [ ${#items[@]} -eq 0 ]; then for p in "$here"/*.patch; do items+=("$(basename "$p" .patch)"); done; fi
work="$(mktemp -d /tmp/baton-reverts-XXXXXX)"
trap 'for d in "$work"/tree-*; do git -C "$root" worktree remove --force "$d" >/dev/null 2>&1 || true; done; rm -rf "$work"' EXIT

one() {
  local item="$1" tree="$work/tree-$1" out="$work/$1.out"
  git -C "$root" worktree add --detach "$tree" HEAD >/dev/null 2>&1
  ln -s "$root/node_modules" "$tree/node_modules"
  if ! git -C "$tree" apply "$here/$item.patch" 2>/dev/null; then echo "| $item | patch no longer applies | | | |"; return; fi
  (cd "$tree" && npx tsc -p . >/dev/null 2>&1) || { echo "| $item | reverted tree does not build | | | |"; return; }
  local t0; t0=$(date +%s)
  (cd "$tree" && node dist/test/sim/main.js --seeds "$max" --no-shrink --ignore-known > "$out" 2>&1) || true
  local t1; t1=$(date +%s)
  local line; line="$(grep -m1 '^seed [0-9]*: FAILED' "$out" || true)"
  if [ -z "$line" ]; then echo "| $item | not found in $max seeds | | | $((t1 - t0)) s |"; return; fi
  local seed check replay
  seed="$(sed -E 's/^seed ([0-9]+): FAILED ([^:]+):.*/\1/' <<<"$line")"
  check="$(sed -E 's/^seed ([0-9]+): FAILED ([^:]+):.*/\2/' <<<"$line")"
  replay="$(grep -m1 '^replay:' "$out" | sed 's/^replay: //')"
  echo "| $item | $seed | $check | \`$replay\` | $((t1 - t0)) s |"
}

echo "| item | seeds to the first failure (= that seed) | check | replay (on the reverted tree) | real time |"
echo "|---|---|---|---|---|"
running=0
for item in "${items[@]}"; do
  one "$item" > "$work/$item.row" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n || true; running=$((running - 1)); fi
done
wait || true
for item in "${items[@]}"; do cat "$work/$item.row"; done
