#!/usr/bin/env bash
# Macro-benchmarks (`npm run bench`): build, then run each scenario. Knobs are environment
# variables, see bench/README.md: SIZE (1G), RUNTIME (fio seconds, 10), REPEAT (1),
# LOCAL (1), PROFILE (0) for nbd-throughput; STEPS, FLUSH_RUNTIME, LATENCY_MS, COPY_SIZE … for
# volume; RUNS, LEASE_TTL for handoff. SCENARIOS picks scenarios (default: "nbd-throughput
# volume handoff"). Results land in bench/results/ (table .md, everything .json).
# fork (fork time on 1 GiB/1 TiB volumes, read latency root vs 50-deep fork): FORK_SIZES, WRITTEN, DEPTH, PASSES.
# gc (space amplification after a churn workload: stored ÷ live after GC alone and after compaction + GC, GC run times): SIZE, LIVE, CHURN, SEED, BELOW, MAX_OP_MS, RGW, RGW_BELOW.
# fleet (one store with 10, 1,000 and 10,000 volumes: ls, info, serve start-up, attach, GC requests): VOLUMES, WRITTEN_EVERY, MAX_OP_MS.
# scale (maps of 10k, 1M and 10M extents: memory, checkpoint, recovery, compaction planning, event-loop delay): EXTENTS, DATA_EVERY, FLUSH_EVERY.
# hydrate (issue 13: the seed's workspace, ~10,000 files, read on the host that built it vs a new host with an empty cache, --hydrate off / working-set / all; file: +20 ms and radosgw; root): SIZE, PACKAGES, FILES, LATENCY_MS, ROUNDS, FILE, RGW, SEED.
# frames (issue 16: store ÷ logical bytes of workspaces and random data, throughput and FLUSH of raw / crc / lz4 / encrypted volumes; ext4 rows need root): SIZE, REPEAT, RUNTIME, RGW, WORKSPACES, SEED.
# workspace-forks (three forks of the seed's git + npm workspace on ext4: fork, attach, commit, fsck, store bytes, rm + gc; root): SIZE, RGW, SEED.
# soak is not in the default list (it runs 10 minutes): SCENARIOS=soak DURATION=10m npm run bench, or
# node dist/bench/soak.js --duration 10m (root, redis-server, radosgw, fio, nbdfuse; see bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! npx tsc -p .; then
  echo "bench: the full build has type errors (above); building only bench/ and cli/ (bench/tsconfig.json)" >&2
  npx tsc -p bench/tsconfig.json
fi
failed=()
export BENCH_STARTED=$(($(date +%s%N) / 1000000))
for s in ${SCENARIOS:-nbd-throughput volume handoff fork workspace-forks hydrate gc scale fleet frames}; do
  if [[ "$s" == volume ]] && { [[ $EUID -ne 0 ]] || ! command -v radosgw >/dev/null; }; then
    # radosgw (scripts/rgw.sh) and losetup/mount for ext4 over nbdfuse.
    echo "bench: skipping volume: it needs root and radosgw (scripts/install-deps.sh)" >&2
    continue
  fi
  if [[ "$s" == workspace-forks || "$s" == hydrate ]] && [[ $EUID -ne 0 ]]; then
    # losetup and mount for ext4 over nbdfuse (radosgw is used when installed, not required).
    echo "bench: skipping $s: it needs root (losetup, mount)" >&2
    continue
  fi
  echo "bench: $s" >&2
  if [[ "$s" == scale ]]; then
    # Its memory rows need global.gc; a 10M-extent map needs more than the default old space.
    node --expose-gc --max-old-space-size=8192 "dist/bench/$s.js" || failed+=("$s")
    continue
  fi
  node "dist/bench/$s.js" || failed+=("$s")
done
node dist/bench/goals.js
if (( ${#failed[@]} > 0 )); then
  echo "bench: failed: ${failed[*]}" >&2
  exit 1
fi
