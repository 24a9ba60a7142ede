/**
 * What `serve --metrics` adds, piece by piece, measured in one process with the two sides
 * alternated many times (issue 14). The fio comparison in nbd-throughput (METRICS=1) is the
 * end-to-end check, but on a shared 2-core machine its passes differ by ±20 % from each other,
 * far more than the 3 % it should bound; these are the costs it is made of:
 *
 *   1. the per-request work in the NBD session: RequestStats.done, against a call of an empty
 *      function with the same arguments (what the session would do anyway is not counted);
 *   2. the store layers on every NBD READ of a `file:` store: a 4 KiB in-place read through
 *      the store stack `serve --metrics` opens (openStore with `instrument`) against the one
 *      `serve` opens without it, 32 in flight, as fio's QD32;
 *   3. one scrape: CPU time of `registry.metrics()` (prom-client text of every series, the
 *      process metrics included) with 1, 10 and 100 served volumes of the real engine.
 *
 * Knobs: ROUNDS (15: alternations per comparison). Results: bench/results/metrics-cost.md
 * and .json. Run: `node dist/bench/metrics-cost.js` (about 30 s).
 */

import * as os from 'node:os';
import * as path from 'node:path';
import { RequestStats } from '../nbd/stats.js';
import { BlockCache } from '../src/cache.js';
import { VolumeExports } from '../src/exports.js';
import { silentLogger } from '../src/log.js';
import { createMetricsRegistry } from '../src/metrics.js';
import { InstrumentedObjectStore } from '../src/store/decorators.js';
import { MemoryObjectStore } from '../src/store/memory.js';
import { openStore } from '../src/store/open.js';
import type { LocalObjects } from '../src/store/object-store.js';
import { StoreCatalog } from '../src/volume/catalog.js';
import { envNumber, fmt, machineInfo, makeTempDir, markdownTable, median, writeResults } from './lib.js';

const ROUNDS = Math.max(3, Math.floor(envNumber('ROUNDS', 15)));
const MiB = 1024 * 1024;

/** CPU microseconds (user + system) of this process while fn runs. */
async function cpuUs(fn: () => Promise<void> | void): Promise<number> {
  const c0 = process.cpuUsage();
  await fn();
  const c = process.cpuUsage(c0);
  return c.user + c.system;
}

/**
 * 1. RequestStats.done per call, loop included (an upper bound: the session calls it from a
 * callback it runs anyway). Against the same loop calling nothing.
 */
function requestStatsCost(): { withNs: number; withoutNs: number } {
  const N = 2_000_000;
  const stats = new RequestStats();
  const types = [0, 1, 0, 1, 0, 1, 3, 4];
  let sink = 0;
  const run = (count: boolean): number => {
    const t0 = process.hrtime.bigint();
    if (count) for (let i = 0; i < N; i++) stats.done(types[i & 7]!, 0, 4096, -1);
    else for (let i = 0; i < N; i++) sink += types[i & 7]!;
    return Number(process.hrtime.bigint() - t0) / N;
  };
  const withNs: number[] = [];
  const withoutNs: number[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    withoutNs.push(run(false));
    withNs.push(run(true));
  }
  if (sink < 0) process.stdout.write(''); // keep the baseline loop's work alive
  return { withNs: median(withNs), withoutNs: median(withoutNs) };
}

/** 2. µs per 4 KiB local read, 32 in flight, through serve's store stack with and without `instrument`. */
async function localReadCost(): Promise<{ plainUs: number; instrumentedUs: number }> {
  const dir = makeTempDir('baton-bench-metrics-');
  const url = `file:${path.join(dir, 'store')}`;
  const store = openStore(url);
  const withMetrics = openStore(url, { instrument: true });
  const size = 64 * MiB;
  await store.local!.putParts('vol/x/seg/1', [Buffer.alloc(size, 7)]);
  const plain = store.local!;
  const counted = withMetrics.local!;
  const out = Buffer.alloc(32 * 4096);
  let next = 1;
  const batch = async (local: LocalObjects): Promise<void> => {
    const ps: Promise<void>[] = [];
    for (let j = 0; j < 32; j++) {
      next = (next * 1103515245 + 12345) % 2147483648;
      ps.push(local.read('vol/x/seg/1', (next % (size / 4096)) * 4096, 4096, out, j * 4096));
    }
    await Promise.all(ps);
  };
  const BATCHES = 1500;
  const time = async (local: LocalObjects): Promise<number> => {
    const t0 = performance.now();
    for (let b = 0; b < BATCHES; b++) await batch(local);
    return ((performance.now() - t0) * 1000) / (BATCHES * 32);
  };
  await time(plain); // warm the page cache and the JIT
  await time(counted);
  const p: number[] = [];
  const c: number[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    p.push(await time(plain));
    c.push(await time(counted));
  }
  await store.close();
  await withMetrics.close();
  return { plainUs: median(p), instrumentedUs: median(c) };
}

/** 3. CPU ms of one scrape with `volumes` served volumes (memory: store, written and flushed once each). */
async function scrapeCost(volumes: number): Promise<{ cpuMs: number; bytes: number; series: number }> {
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const store = new InstrumentedObjectStore(new MemoryObjectStore());
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache });
  const exports = new VolumeExports(catalog, { readOnly: false, idleGraceMs: 600_000, log: silentLogger(), requestStats: true });
  const handles = [];
  for (let i = 0; i < volumes; i++) {
    await catalog.create(`v${i}`, 64 * MiB);
    const h = await exports.open(`v${i}`);
    await h.backend.write(0, Buffer.alloc(4096, 1), false);
    await h.backend.flush();
    h.stats!.done(1, 0, 4096, -1);
    h.stats!.done(3, 0, 0, performance.now());
    handles.push(h);
  }
  const registry = createMetricsRegistry({ volumes: exports, store, cache: await cache, info: { hostId: 'bench', store: 'memory:', version: 'bench' } });
  let text = await registry.metrics();
  const per: number[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    const n = 10;
    per.push((await cpuUs(async () => { for (let i = 0; i < n; i++) text = await registry.metrics(); })) / n / 1000);
  }
  for (const h of handles) h.release();
  await exports.close();
  return { cpuMs: median(per), bytes: Buffer.byteLength(text), series: text.split('\n').filter((l) => l && !l.startsWith('#')).length };
}

async function main(): Promise<void> {
  const machine = machineInfo();
  const log = (s: string): void => { process.stderr.write(s + '\n'); };
  log(`metrics-cost: ROUNDS=${ROUNDS}; ${machine.nproc} cores, node ${machine.node}, load ${machine.loadavgAtStart.join(' ')}`);
  const rs = requestStatsCost();
  log(`  RequestStats.done: ${fmt(rs.withNs)} ns per call, an empty call ${fmt(rs.withoutNs)} ns`);
  const lr = await localReadCost();
  log(`  local 4 KiB read, QD32: ${fmt(lr.plainUs)} µs plain, ${fmt(lr.instrumentedUs)} µs instrumented`);
  const scrapes: { volumes: number; cpuMs: number; bytes: number; series: number }[] = [];
  for (const volumes of [1, 10, 100]) {
    const s = await scrapeCost(volumes);
    scrapes.push({ volumes, ...s });
    log(`  scrape, ${volumes} volumes: ${fmt(s.cpuMs)} ms CPU, ${s.bytes} bytes, ${s.series} samples`);
  }
  const loadEnd = os.loadavg();
  const L: string[] = [];
  L.push('# What serve --metrics costs, piece by piece\n');
  L.push(`${machine.date.slice(0, 16).replace('T', ' ')} UTC on \`${machine.hostname}\`: ${machine.nproc} cores, node ${machine.node}, baton ${machine.batonCommit ?? '?'}; load average ${machine.loadavgAtStart.join(' ')} at the start, ${loadEnd.map((x) => x.toFixed(2)).join(' ')} at the end. Medians of ${ROUNDS} alternations.\n`);
  L.push(markdownTable(['what', 'without metrics', 'with metrics', 'added'], [
    ['NBD session, per request: RequestStats.done, loop included (vs the bare loop)', `${fmt(rs.withoutNs)} ns`, `${fmt(rs.withNs)} ns`, `${fmt(rs.withNs - rs.withoutNs)} ns`],
    ['file: store, per 4 KiB READ piece, QD32: in-place read through serve\'s store stack (with vs without `instrument`)', `${fmt(lr.plainUs)} µs`, `${fmt(lr.instrumentedUs)} µs`, `${fmt(lr.instrumentedUs - lr.plainUs)} µs`],
    ...scrapes.map((s) => [`one scrape of /metrics, ${s.volumes} served volume${s.volumes > 1 ? 's' : ''} (${s.series} samples, ${s.bytes} bytes)`, '–', `${fmt(s.cpuMs)} ms CPU`, `${fmt(s.cpuMs / 10)} % of a core scraped every second, ${fmt(s.cpuMs / 150)} % every 15 s`]),
  ], ['l', 'r', 'r', 'r']));
  const json = { benchmark: 'metrics-cost', knobs: { ROUNDS }, machine, loadavgAtEnd: loadEnd, requestStats: rs, localRead: lr, scrapes };
  const written = writeResults('metrics-cost', L.join('\n') + '\n', json);
  process.stdout.write(L.join('\n') + '\n');
  log(`wrote ${path.relative(process.cwd(), written.md)}`);
}

main().catch((e: unknown) => {
  process.stderr.write(`metrics-cost: ${(e as Error).stack ?? String(e)}\n`);
  process.exit(1);
});
