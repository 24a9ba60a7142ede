#!/usr/bin/env bash
# Macro-benchmarks (`npm run bench`): build, then run each scenario. Knobs are environment
# variables, see bench/README.md: SIZE (1G), RUNTIME (fio seconds, 10), REPEAT (1),
# LOCAL (1), PROFILE (0). Results land in bench/results/ (table .md, everything .json).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! npx tsc -p .; then
  echo "bench: the full build has type errors (above); building only bench/ and cli/ (bench/tsconfig.json)" >&2
  npx tsc -p bench/tsconfig.json
fi
node dist/bench/nbd-throughput.js
