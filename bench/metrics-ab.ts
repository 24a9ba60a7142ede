/**
 * `serve --metrics` on vs off, interleaved (issue 14): for each store two servers run side by
 * side, one without metrics and one with `--metrics` scraped every second, and short fio runs
 * alternate between them (A B, then B A, ...). On a shared machine whose load drifts within
 * minutes, nbd-throughput's METRICS=1 compares passes a minute apart; here the two sides of
 * each pair are seconds apart, and the pairs' ratios are summarised (median, geometric mean
 * with a 95 % interval), so a few percent can be told from the machine's drift.
 *
 * Per store, per round, per workload (fio 4k randread and randwrite, QD32, nbd engine): IOPS
 * of each side, and its server's CPU time over the run divided by the I/Os (µs per I/O).
 *
 * Knobs: BATON_STORES (`ram:,file:`), ROUNDS (10), RUNTIME (fio seconds per run, 5), SIZE
 * (256M: the volume, filled once by nbdcopy so reads find data). Results:
 * bench/results/metrics-ab.md and .json. About 2 × ROUNDS × 2 × RUNTIME s per store.
 * RESTART=K starts both sides afresh every K rounds, so the interval also holds what differs
 * between two processes of the same build (one pair for the whole run cannot show that).
 * To weigh one part of metrics, OFF_ARGS and ON_ARGS add arguments to either side (split on
 * spaces; `{port}` becomes a free port), e.g. OFF_ARGS='--metrics 127.0.0.1:{port}'
 * ON_ARGS=--metrics-gc: the GC histogram alone (the "off" side has metrics, unscraped).
 */

import * as os from 'node:os';
import { formatSize } from '../src/size.js';
import {
  envNumber, envSize, fmt, fmtRatio, freeTcpPort, machineInfo, makeRandomFile, makeTempDir, markdownTable, median, runFio, runNbdcopy,
  startBaton, startMetricsScraper, writeResults, type Server,
} from './lib.js';

const STORES = (process.env.BATON_STORES || 'ram:,file:').split(',').map((x) => x.trim()).filter(Boolean);
const ROUNDS = Math.max(2, Math.floor(envNumber('ROUNDS', 10)));
const RUNTIME = envNumber('RUNTIME', 5);
const SIZE = envSize('SIZE', '256M');
const WORKLOADS = ['randread', 'randwrite'] as const;
/** Start both sides afresh every RESTART rounds (0: one pair of processes for the whole run). */
const RESTART = Math.max(0, Math.floor(envNumber('RESTART', 0)));
const OFF_ARGS = process.env.OFF_ARGS ?? '';
const ON_ARGS = process.env.ON_ARGS ?? '';

/** OFF_ARGS / ON_ARGS as arguments, each `{port}` a free TCP port. */
async function extraArgs(spec: string): Promise<string[]> {
  const out: string[] = [];
  for (const a of spec.split(' ').filter(Boolean)) out.push(a.includes('{port}') ? a.replace('{port}', String(await freeTcpPort())) : a);
  return out;
}

interface Sample { round: number; side: 'off' | 'on'; rw: string; iops: number; cpuUsPerIo: number; load1: number }

/** Geometric mean of ratios and its 95 % interval (t on the log ratios). */
function geoSummary(ratios: number[]): { mean: number; lo: number; hi: number } {
  const logs = ratios.filter((r) => r > 0 && Number.isFinite(r)).map(Math.log);
  const n = logs.length;
  if (n < 2) return { mean: NaN, lo: NaN, hi: NaN };
  const m = logs.reduce((a, b) => a + b, 0) / n;
  const sd = Math.sqrt(logs.reduce((a, b) => a + (b - m) ** 2, 0) / (n - 1));
  // Two-sided 97.5 % quantiles of Student's t for n-1 degrees of freedom (1..29), then ~1.96.
  const T = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05];
  const t = T[n - 2] ?? 1.96;
  const half = (t * sd) / Math.sqrt(n);
  return { mean: Math.exp(m), lo: Math.exp(m - half), hi: Math.exp(m + half) };
}

async function main(): Promise<void> {
  const log = (s: string): void => { process.stderr.write(s + '\n'); };
  const machine = machineInfo();
  log(`metrics-ab: BATON_STORES=${STORES.join(',')} ROUNDS=${ROUNDS} RUNTIME=${RUNTIME}s SIZE=${formatSize(SIZE)}; ${machine.nproc} cores, load ${machine.loadavgAtStart.join(' ')}`);
  const rnd = makeRandomFile(SIZE);
  const started = Date.now();
  const results: { store: string; samples: Sample[]; argv: { off: string[]; on: string[] } }[] = [];
  for (const store of STORES) {
    const servers: Partial<Record<'off' | 'on', Server>> = {};
    const scraper = { current: null as ReturnType<typeof startMetricsScraper> | null };
    const scraped = { scrapes: 0, requestsCounted: 0 };
    const samples: Sample[] = [];
    let argv: { off: string[]; on: string[] } = { off: [], on: [] };
    /** Stop the pair running (if any), adding up its scrapes; a dead metrics side fails the run. */
    const stopPair = async (): Promise<void> => {
      if (scraper.current) {
        const sc = await scraper.current.stop();
        scraper.current = null;
        if (sc.errors > 0 || sc.requestsCounted === 0) throw new Error(`the metrics side was not live: ${JSON.stringify(sc)}`);
        scraped.scrapes += sc.scrapes;
        scraped.requestsCounted += sc.requestsCounted;
      }
      await servers.off?.stop();
      await servers.on?.stop();
      delete servers.off;
      delete servers.on;
    };
    const startPair = async (): Promise<void> => {
      const port = await freeTcpPort();
      // A long idle grace on both: each side is idle while the other is measured, and a volume
      // closed after 5 s idle would be reopened (recovered) at every run, and its series reset.
      const common = ['--idle-grace', '3600'];
      servers.off = await startBaton({ dir: makeTempDir('baton-bench-ab-'), volume: 'ab', size: SIZE, store, extraArgs: [...common, ...await extraArgs(OFF_ARGS)] });
      servers.on = await startBaton({ dir: makeTempDir('baton-bench-ab-'), volume: 'ab', size: SIZE, store, extraArgs: [...common, '--metrics', `127.0.0.1:${port}`, ...await extraArgs(ON_ARGS)] });
      argv = { off: servers.off.argv, on: servers.on.argv };
      for (const side of ['off', 'on'] as const) await runNbdcopy(rnd.path, servers[side]!.uri, SIZE, { flush: true });
      scraper.current = startMetricsScraper(port, 1000);
    };
    try {
      await startPair();
      for (let round = 0; round < ROUNDS; round++) {
        if (RESTART > 0 && round > 0 && round % RESTART === 0) {
          // New processes for both sides: what differs between two processes (where the
          // scheduler puts them, what the JIT made of them) is then inside the interval.
          await stopPair();
          await startPair();
        }
        const order = round % 2 === 0 ? (['off', 'on'] as const) : (['on', 'off'] as const);
        for (const rw of WORKLOADS) {
          for (const side of order) {
            const server = servers[side]!;
            const dir = makeTempDir('baton-bench-ab-fio-');
            const cpu0 = server.cpuSeconds();
            const load1 = os.loadavg()[0]!;
            const r = await runFio({ name: rw, rw, bs: '4k', iodepth: 32, runtime: RUNTIME, size: SIZE, ioengine: 'nbd', uri: server.uri }, dir);
            const cpu = server.cpuSeconds() - cpu0;
            const s: Sample = { round, side, rw, iops: r.iops, cpuUsPerIo: (cpu * 1e6) / (r.iops * RUNTIME), load1 };
            samples.push(s);
            log(`  ${store} #${round + 1} ${rw} ${side}: ${fmt(s.iops)} IOPS, ${fmt(s.cpuUsPerIo)} µs CPU per I/O (load ${load1.toFixed(2)})`);
          }
        }
      }
      await stopPair();
      log(`  ${store}: ${scraped.scrapes} scrapes, ${scraped.requestsCounted} NBD requests counted`);
      results.push({ store, samples, argv });
    } finally {
      await scraper.current?.stop().catch(() => {});
      await servers.off?.stop();
      await servers.on?.stop();
    }
  }
  const L: string[] = [];
  L.push('# serve --metrics on vs off, interleaved\n');
  L.push(`${machine.date.slice(0, 16).replace('T', ' ')} UTC on \`${machine.hostname}\`: ${machine.nproc} cores (${machine.cpuModel}), node ${machine.node}, ${machine.fio ?? 'fio ?'}, baton ${machine.batonCommit ?? '?'}; load average ${machine.loadavgAtStart.join(' ')} at the start, ${os.loadavg().map((x) => x.toFixed(2)).join(' ')} at the end; ${((Date.now() - started) / 1000).toFixed(0)} s.`);
  L.push(`Per store two servers side by side (\`baton serve --store STORE --idle-grace 3600\`, and the same with \`--metrics 127.0.0.1:PORT\` scraped every second)${OFF_ARGS || ON_ARGS ? `, plus OFF_ARGS \`${OFF_ARGS}\` and ON_ARGS \`${ON_ARGS}\`` : ''}, ${formatSize(SIZE)} volumes filled by nbdcopy; ${RESTART > 0 ? `both started afresh every ${RESTART} rounds; ` : ''}${ROUNDS} rounds, each a ${RUNTIME} s \`fio --ioengine=nbd --bs=4k --iodepth=32\` run per workload on each side, the order alternating. Ratios are on ÷ off of each round's pair.\n`);
  const rows: string[][] = [];
  for (const { store, samples } of results) {
    for (const rw of WORKLOADS) {
      const pick = (side: 'off' | 'on'): Sample[] => samples.filter((s) => s.rw === rw && s.side === side);
      const pairs = pick('on').map((on) => [on, pick('off').find((off) => off.round === on.round)!] as const);
      const iops = geoSummary(pairs.map(([on, off]) => on.iops / off.iops));
      const cpu = geoSummary(pairs.map(([on, off]) => on.cpuUsPerIo / off.cpuUsPerIo));
      rows.push([`\`${store}\` ${rw}`, fmt(median(pick('off').map((s) => s.iops))), fmt(median(pick('on').map((s) => s.iops))),
        fmtRatio(median(pairs.map(([on, off]) => on.iops / off.iops))), `${fmtRatio(iops.mean)} (${fmtRatio(iops.lo)}–${fmtRatio(iops.hi)})`,
        `${fmt(median(pick('off').map((s) => s.cpuUsPerIo)))} / ${fmt(median(pick('on').map((s) => s.cpuUsPerIo)))}`, `${fmtRatio(cpu.mean)} (${fmtRatio(cpu.lo)}–${fmtRatio(cpu.hi)})`]);
    }
  }
  L.push(markdownTable(['store, fio 4k QD32', 'IOPS off (median)', 'IOPS on (median)', 'on ÷ off, median of pairs', 'on ÷ off, geometric mean (95 % interval)', 'server CPU µs per I/O, off / on', 'CPU per I/O on ÷ off (95 % interval)'], rows, ['l', 'r', 'r', 'r', 'r', 'r', 'r']));
  L.push('IOPS ↑ (a ratio below 1 is what metrics cost); CPU per I/O ↓ (a ratio above 1 is what metrics cost).\n');
  const json = { benchmark: 'metrics-ab', knobs: { STORES, ROUNDS, RUNTIME, SIZE, RESTART, OFF_ARGS, ON_ARGS }, machine, loadavgAtEnd: os.loadavg(), results };
  const written = writeResults('metrics-ab', L.join('\n') + '\n', json);
  process.stdout.write(L.join('\n') + '\n');
  log(`wrote ${written.md}`);
}

main().catch((e: unknown) => {
  process.stderr.write(`metrics-ab: ${(e as Error).stack ?? String(e)}\n`);
  process.exit(1);
});
