/**
 * npm run sim -- [--seeds N] [--seed S] [--steps K] [--off a,b] [--workload engine|served|lifecycle] [--verbose] [--no-shrink] [--keep-going] [--ignore-known] [--stats]
 *
 * Runs N seeds starting at S (default 1); prints seeds per second and simulated hours per
 * real minute; for the first failing seed, the shrunk trace and the command that replays it.
 * Exit code 1 if any seed failed.
 */
import { DEFAULT_STEPS, describeFailure, replayCommand, runSeed, shrink } from './sim.js';
import { KNOWN_OPEN, type WorkloadName } from './run.js';

function arg(name: string): string | undefined {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : undefined;
}
const flag = (name: string): boolean => process.argv.includes(`--${name}`);

async function main(): Promise<void> {
  const single = arg('seed') !== undefined && arg('seeds') === undefined;
  const first = Number(arg('seed') ?? 1);
  const count = single ? 1 : Number(arg('seeds') ?? 100);
  const steps = Number(arg('steps') ?? DEFAULT_STEPS);
  const off = new Set((arg('off') ?? '').split(',').filter(Boolean));
  const workload = arg('workload') as WorkloadName | undefined;
  const verbose = flag('verbose');
  const t0 = performance.now();
  let simMs = 0;
  let failures = 0;
  let lastReport = t0;
  const base = { steps, off, ...(workload ? { workload } : {}) };
  const totals: Record<string, number> = {};
  for (let i = 0; i < count; i++) {
    const seed = first + i;
    const r = await runSeed({ seed, ...base, verbose: verbose && single });
    simMs += r.simMs;
    for (const [k, v] of Object.entries(r.stats)) totals[k] = k.startsWith('max') ? Math.max(totals[k] ?? 0, v) : (totals[k] ?? 0) + v;
    if (single) {
      if (verbose || !r.ok) for (const l of r.trace) console.log(l);
      console.log(`seed ${seed}: ${r.ok ? 'ok' : `FAILED ${r.violation!.check}`} (${r.workload}, ${r.stepsTaken} steps, ${r.events} events, ${(r.simMs / 1000).toFixed(1)} s simulated in ${(r.realMs / 1000).toFixed(2)} s)`);
      console.log(JSON.stringify(r.stats));
      if (!r.ok) { console.log(r.violation!.message); console.log(`replay: ${replayCommand(r)}`); failures++; }
      continue;
    }
    if (!r.ok && flag('ignore-known') && KNOWN_OPEN.includes(r.violation!.check)) {
      console.log(`seed ${seed}: known open finding ${r.violation!.check} (ignored)`);
    } else if (!r.ok) {
      failures++;
      console.log(`seed ${seed}: FAILED ${r.violation!.check}: ${r.violation!.message}`);
      if (!flag('no-shrink')) {
        const s = await shrink(r, { log: (l) => console.log(l) });
        console.log(describeFailure(s.result));
      } else console.log(`replay: ${replayCommand(r)}`);
      if (!flag('keep-going')) break;
    }
    const now = performance.now();
    if (now - lastReport > 10_000 || i === count - 1) {
      lastReport = now;
      const secs = (now - t0) / 1000;
      console.log(`${i + 1}/${count} seeds, ${failures} failed, ${((i + 1) / secs).toFixed(2)} seeds/s, ${(simMs / 3.6e6 / (secs / 60)).toFixed(1)} simulated hours per real minute`);
    }
  }
  if (flag('stats')) console.log(JSON.stringify(totals, null, 1));
  process.exitCode = failures > 0 ? 1 : 0;
}

void main();
