/**
 * A worker thread that runs a list of seeds (sim.test.ts runs the CI budget on two of them,
 * one per core) and posts back one summary per seed.
 */
import { parentPort, workerData } from 'node:worker_threads';
import { describeFailure, runSeed } from './sim.js';

export interface SeedSummary {
  seed: number;
  ok: boolean;
  check: string | null;
  workload: string;
  simMs: number;
  realMs: number;
  events: number;
  /** For a failure: the seed, its trace tail and the replay command. */
  report: string | null;
}

const { seeds, steps } = workerData as { seeds: number[]; steps: number };
const out: SeedSummary[] = [];
for (const seed of seeds) {
  const r = await runSeed({ seed, steps });
  out.push({ seed, ok: r.ok, check: r.violation?.check ?? null, workload: r.workload, simMs: r.simMs, realMs: r.realMs, events: r.events, report: r.ok ? null : describeFailure(r, 60) });
}
parentPort!.postMessage(out);
