/**
 * Running seeds and shrinking failures (shared by the CLI, test/sim/main.ts, and the ava
 * suite, test/sim/sim.test.ts).
 *
 * Shrinking: a failing (seed, steps, classes off) is re-run with each fault or feature class
 * turned off in turn (kept off if it still fails with the same check), then with fewer steps
 * (the smallest budget found that still fails). Same seed, so the run up to the cut is the
 * same run; what is printed is the shortest trace that still fails and the command that
 * replays it.
 */

import { engineWorkload } from './engine.js';
import { CLASSES, SimRun, type RunOptions, type RunResult, type WorkloadName } from './run.js';
import { servedWorkload } from './served.js';

export const DEFAULT_STEPS = 300;

export async function runSeed(o: RunOptions): Promise<RunResult> {
  const run = new SimRun(o);
  return run.run(run.workloadName === 'served' ? servedWorkload : engineWorkload);
}

export interface Shrunk { result: RunResult; runs: number }

/** The smallest failing run found from `failed` (same seed, same kind of failure). */
export async function shrink(failed: RunResult, opts: { workload?: WorkloadName; maxRuns?: number; log?: (s: string) => void } = {}): Promise<Shrunk> {
  const check = failed.violation!.check;
  let best = failed;
  let runs = 0;
  const maxRuns = opts.maxRuns ?? 40;
  const tryRun = async (steps: number, off: Set<string>): Promise<RunResult | null> => {
    if (runs >= maxRuns) return null;
    runs++;
    const r = await runSeed({ seed: failed.seed, steps, off, workload: failed.workload });
    const same = !r.ok && r.violation!.check === check;
    opts.log?.(`  shrink: steps ${steps} off [${[...off].join(',')}]: ${same ? 'still fails' : r.ok ? 'passes' : `fails differently (${r.violation!.check})`}`);
    return same ? r : null;
  };
  // Fault and feature classes off, one at a time.
  for (const c of CLASSES) {
    if (best.off.includes(c)) continue;
    const r = await tryRun(best.steps, new Set([...best.off, c]));
    if (r) best = r;
  }
  // Fewer steps: the failure happened after `stepsTaken` steps; search below that.
  let hi = Math.min(best.steps, best.stepsTaken);
  const r0 = hi < best.steps ? await tryRun(hi, new Set(best.off)) : null;
  if (r0) best = r0;
  let lo = 1;
  while (lo < hi && runs < maxRuns) {
    const mid = Math.floor((lo + hi) / 2);
    const r = await tryRun(mid, new Set(best.off));
    if (r) { best = r; hi = mid; } else lo = mid + 1;
  }
  return { result: best, runs };
}

export function replayCommand(r: RunResult): string {
  return `npm run sim -- --seed ${r.seed} --steps ${r.steps}${r.off.length ? ` --off ${r.off.join(',')}` : ''} --workload ${r.workload} --verbose`;
}

export function describeFailure(r: RunResult, traceLines = 120): string {
  const v = r.violation!;
  const tail = r.trace.slice(-traceLines);
  return [
    `seed ${r.seed} FAILED (${r.workload} workload, ${r.stepsTaken} steps, ${(r.simMs / 1000).toFixed(1)} s simulated): ${v.check}`,
    `  ${v.message}`,
    `trace (last ${tail.length} of ${r.trace.length} lines):`,
    ...tail.map((l) => `  ${l}`),
    `replay: ${replayCommand(r)}`,
  ].join('\n');
}
