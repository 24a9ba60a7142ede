#!/usr/bin/env bash
# The simulator's revert table: for each fix, put the code back as it was before the fix
# (ITEM.patch, a minimal revert of the one mechanism), build that tree apart, and run seeds
# 1, 2, ... until the simulator fails; print the first failing seed, its check and the time.
# A simulator that finds no reverted fix finds nothing: this is its proof of power.
#
#   bash test/sim/reverts/run.sh                 # every patch here, up to 3000 seeds each
#   bash test/sim/reverts/run.sh 9.1 9.7         # some
#   MAX_SEEDS=500 JOBS=2 bash test/sim/reverts/run.sh
#   bash test/sim/reverts/run.sh --check        # each seed of regressions.json fails on its revert
#
# Each patch applies to the commit it was made on; one that no longer applies is reported as
# such (make it again against the current code: it is the fix, undone).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
max="${MAX_SEEDS:-3000}"
jobs="${JOBS:-2}"
check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
items=("$@")
if [ ${#items[@]} -eq 0 ]; then for p in "$here"/*.patch; do items+=("$(basename "$p" .patch)"); done; fi
work="$(mktemp -d /tmp/baton-reverts-XXXXXX)"
trap 'for d in "$work"/tree-*; do git -C "$root" worktree remove --force "$d" >/dev/null 2>&1 || true; done; rm -rf "$work"' EXIT

# A tree of HEAD with one fix reverted, built apart (prints nothing; fails if it cannot).
tree() {
  local item="$1" tree="$work/tree-$1"
  [ -d "$tree" ] && return 0
  git -C "$root" worktree add --detach "$tree" HEAD >/dev/null 2>&1
  ln -s "$root/node_modules" "$tree/node_modules"
  git -C "$tree" apply "$here/$item.patch" 2>/dev/null || return 1
  (cd "$tree" && npx tsc -p . >/dev/null 2>&1) || return 2
}

if [ "$check" = 1 ]; then
  # Every regression seed must fail on the tree with its fix reverted (and pass on HEAD:
  # sim.test.ts). A seed that no longer fails there guards nothing: find a new one.
  bad=0
  while IFS=$'\t' read -r item revert seed steps workload check off; do
    if ! tree "$revert"; then echo "$item: revert $revert does not apply or build"; bad=1; continue; fi
    args=(--seed "$seed" --steps "$steps" --workload "$workload"); [ -n "$off" ] && args+=(--off "$off")
    line="$(cd "$work/tree-$revert" && node dist/test/sim/main.js "${args[@]}" 2>&1 | grep '^seed' || true)"
    case "$line" in *"FAILED $check "*) echo "ok   $item: $line";; *) echo "FAIL $item (revert $revert; expected $check): $line"; bad=1;; esac
  done < <(node -e 'for (const r of require(process.argv[1])) console.log([r.item, r.revert, r.seed, r.steps, r.workload, r.check, (r.off ?? []).join(",")].join("\t"))' "$here/../regressions.json")
  exit "$bad"
fi

one() {
  local item="$1" tree="$work/tree-$1" out="$work/$1.out" rc=0
  tree "$item" || rc=$?
  if [ "$rc" = 1 ]; then echo "| $item | patch no longer applies | | | |"; return; fi
  if [ "$rc" = 2 ]; then echo "| $item | reverted tree does not build | | | |"; return; fi
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
