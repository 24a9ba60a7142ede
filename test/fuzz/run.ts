/**
 * `npm run fuzz -- [--inputs N] [--seed S] [--lanes L] [--only I] [--dump I [--save FILE]] [--replay FILE] [--timeout-ms T] [--idle-grace-ms G] [--inject FAULT] [--max-failures K] [--json]`
 *
 * Runs the NBD protocol fuzzer (test/fuzz/fuzzer.ts) against a fresh server and prints what
 * it found; exit code 1 if anything failed. Without --seed a random seed is chosen and
 * printed, so every run can be replayed.
 */

import { freshSeed } from './rng.js';
import * as fs from 'node:fs';
import { dumpInput, formatFailure, mb, recordInput, runFuzz, type RecordedInput } from './fuzzer.js';

function args(argv: string[]): Map<string, string> {
  const m = new Map<string, string>();
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if (!a.startsWith('--')) throw new Error(`unexpected argument ${a}`);
    const [k, v] = a.includes('=') ? a.slice(2).split('=', 2) as [string, string] : [a.slice(2), argv[i + 1] && !argv[i + 1]!.startsWith('--') ? argv[++i]! : 'true'];
    m.set(k, v);
  }
  return m;
}

function num(m: Map<string, string>, k: string, dflt?: number): number | undefined {
  const s = m.get(k);
  if (s === undefined) return dflt;
  const n = Number(s.replace(/_/g, ''));
  if (!Number.isSafeInteger(n) || n < 0) throw new Error(`--${k} needs a non-negative whole number, got ${s}`);
  return n;
}

async function main(): Promise<void> {
  const a = args(process.argv.slice(2));
  const known = new Set(['inputs', 'seed', 'lanes', 'only', 'dump', 'save', 'replay', 'timeout-ms', 'idle-grace-ms', 'inject', 'max-failures', 'json', 'quiet']);
  for (const k of a.keys()) if (!known.has(k)) throw new Error(`unknown option --${k} (known: ${[...known].map((x) => `--${x}`).join(' ')})`);
  const seed = num(a, 'seed') ?? freshSeed();
  const lanes = num(a, 'lanes', 4)!;
  const dump = num(a, 'dump');
  if (dump !== undefined && a.has('save')) {
    fs.writeFileSync(a.get('save')!, `${JSON.stringify(recordInput(seed, lanes, dump), null, 1)}\n`);
    console.log(`input ${dump} of seed ${seed} (${lanes} lanes) saved to ${a.get('save')}; replay it with --replay ${a.get('save')}`);
    return;
  }
  if (dump !== undefined) { console.log(dumpInput(seed, lanes, dump)); return; }
  const replay = a.get('replay');
  const recorded = replay ? JSON.parse(fs.readFileSync(replay, 'utf8')) as RecordedInput : undefined;
  const only = num(a, 'only');
  const inputs = only !== undefined ? only + 1 : num(a, 'inputs', 20_000)!;
  const quiet = a.has('quiet') || a.has('json');
  const inject = a.get('inject');
  const timeoutMs = num(a, 'timeout-ms');
  console.error(`fuzzing: seed ${seed}, ${only !== undefined ? `input ${only} only` : `${inputs} inputs`}, ${lanes} lanes${inject ? `, injected fault ${inject}` : ''}`);
  const report = await runFuzz({
    seed: recorded?.seed ?? seed, inputs, lanes: recorded?.lanes ?? lanes, maxFailures: num(a, 'max-failures', 1)!,
    ...(recorded ? { recorded } : {}),
    ...(only !== undefined ? { only } : {}),
    ...(inject ? { inject } : {}),
    ...(timeoutMs !== undefined ? { timeoutMs } : {}),
    ...(a.has('idle-grace-ms') ? { idleGraceMs: num(a, 'idle-grace-ms')! } : {}),
    log: quiet ? () => {} : (l) => console.error(l),
  });
  if (a.has('json')) {
    console.log(JSON.stringify({ ...report, stats: { ...report.stats, optReplies: Object.fromEntries(report.stats.optReplies), results: Object.fromEntries(report.stats.results) } }, null, 2));
  } else {
    console.log(`${report.inputs} inputs in ${report.seconds.toFixed(1)} s: ${report.inputsPerSecond.toFixed(0)} inputs/s (seed ${report.seed}, ${report.lanes} lanes, ${report.stalls} stalled handshakes, ${report.stats.handshakeTimeouts} handshakes ended by the server's timer)`);
    console.log(`CPU: fuzzer ${(report.cpu.fuzzerMs / 1000).toFixed(1)} s, server ${(report.cpu.serverMs / 1000).toFixed(1)} s (${((report.cpu.fuzzerMs + report.cpu.serverMs) / report.inputs).toFixed(2)} ms per input)`);
    console.log(`reached transmission ${report.stats.transmissions} times (${report.stats.structured} structured), ${report.stats.blockStatusOk} BLOCK_STATUS replies checked, ${mb(report.stats.readsVerifiedBytes)} of READ data verified`);
    console.log(`well-behaved client: ${report.victim.sessions} sessions, ${report.victim.requests} requests, slowest session ${report.victim.maxSessionMs} ms`);
    const m = report.memory;
    console.log(`server memory (heap + buffers, less stored data, dirty data, cache): baseline ${mb(m.baselineOther)}, steady max ${mb(m.maxSteadyOther)}, sampled peak ${mb(m.peakOther)}; RSS peak ${mb(m.maxRss)}; store ${mb(m.storeBytes)}; ${m.probes} probes`);
    const top = [...report.stats.results.entries()].sort((x, y) => y[1] - x[1]);
    console.log(`request outcomes: ${top.map(([k, n]) => `${k}=${n}`).join(' ')}`);
    const opts = [...report.stats.optReplies.entries()].sort((x, y) => y[1] - x[1]);
    console.log(`option replies: ${opts.map(([k, n]) => `${k}=${n}`).join(' ')}`);
    const warn = Object.entries(report.serverLog);
    if (warn.length) console.log(`server log: ${warn.map(([k, n]) => `${n}× ${k}`).join('; ')}`);
    for (const l of report.serverLogSamples) console.log(`  ${l}`);
  }
  for (const f of report.failures) console.log(formatFailure(f));
  console.log(report.failures.length === 0 ? 'no failures' : `${report.failures.length} failure(s)`);
  process.exitCode = report.failures.length === 0 ? 0 : 1;
}

main().catch((err: unknown) => { console.error(err instanceof Error ? err.stack : err); process.exitCode = 2; });
