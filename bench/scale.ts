/**
 * Cost that grows with the map (issue 12): a volume with many extents, built through the
 * engine, then checkpointed, recovered on a "new host" (a new catalog and process-local
 * state) and walked for compaction planning, with the event loop's delay measured during each.
 *
 * For each size in EXTENTS (10k, 1M, 10M): a 1 TiB sparse volume on a `file:` store in a temp
 * dir; random 4 KiB-aligned offsets over the whole volume, one in DATA_EVERY (100) a 4 KiB
 * write of random bytes, the others a 4 KiB WRITE_ZEROES (NO_HOLE: an allocated zero extent;
 * map entries without data, so 10M extents do not need 40 GB of disk); FLUSH every
 * FLUSH_EVERY (50,000) operations; extents that land next to each other merge, so the map
 * ends slightly below the count asked for (the table says how many it has). Then:
 *
 *   build       time, commits, RSS, and memory per extent after the build (global.gc first):
 *               the JS heap plus ArrayBuffer memory (process.memoryUsage().arrayBuffers, outside
 *               the heap: where the packed committed map, cow/packed-map.ts, keeps its extents);
 *   checkpoint  a forced checkpoint of the whole map: time until it is in the store, its
 *               size, the event loop's delay (max, p99) meanwhile;
 *   recovery    Volume.open on a new catalog (a host with nothing of the volume in memory):
 *               time, event loop delay max meanwhile;
 *   compaction  compactionCandidates (the planning walk over the whole map): time, delay max;
 *   serving     READS (20,000) random 4 KiB reads through Volume.read on the recovered volume,
 *               one at a time, each in an event-loop turn of its own (as requests from a socket
 *               are; every read resolves through the map): time per read, delay max and p99.
 *
 * The event loop's delay is measured by a 1 ms interval timer (the longest gap between two of
 * its ticks minus 1 ms) and perf_hooks' monitorEventLoopDelay (p99), both in this process,
 * which is what a host serving other volumes meanwhile would see.
 *
 * Knobs (environment): EXTENTS (10k,1M,10M), READS (20000), DATA_EVERY (100), FLUSH_EVERY (50000), SEED (1), SCALE_GAPS (1: print
 * every gap of the event loop over 30 ms with its time, to line up with node --trace-gc).
 * Results: bench/results/scale.md and scale.json. Run with node --expose-gc for the memory rows
 * (bench/run.sh does).
 */

import * as fs from 'node:fs';
import * as path from 'node:path';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { BlockCache } from '../src/cache.js';
import { silentLogger } from '../src/log.js';
import { formatSize } from '../src/size.js';
import { seededRandom } from '../src/store/decorators.js';
import { listAll, type ObjectStore } from '../src/store/object-store.js';
import { openStore } from '../src/store/open.js';
import { StoreCatalog } from '../src/volume/catalog.js';
import type { Volume } from '../src/volume/volume.js';
import { MiB, fmt, machineInfo, makeTempDir, markdownTable, writeResults } from './lib.js';

const TiB = 1024 * 1024 * MiB;
const parseCount = (s: string): number => {
  const m = /^(\d+(?:\.\d+)?)([kKmM]?)$/.exec(s.trim());
  if (!m) throw new Error(`EXTENTS: ${s} is not a count like 10k or 1M`);
  return Math.round(Number(m[1]) * (m[2]!.toLowerCase() === 'k' ? 1e3 : m[2]!.toLowerCase() === 'm' ? 1e6 : 1));
};
const EXTENTS = (process.env.EXTENTS || '10k,1M,10M').split(',').map(parseCount);
const DATA_EVERY = Math.max(1, Number(process.env.DATA_EVERY || 100));
const FLUSH_EVERY = Math.max(1, Number(process.env.FLUSH_EVERY || 50_000));
const SEED = Number(process.env.SEED || 1);
const READS = Math.max(1, Number(process.env.READS || 20_000));
const log = (s: string): void => { process.stderr.write(s + '\n'); };
const gc = (): void => { (globalThis as { gc?: () => void }).gc?.(); };

/** The event loop's delay while `fn` runs: the longest gap of a 1 ms timer, and the delay histogram's p99. */
async function withDelay<T>(fn: () => Promise<T>): Promise<{ value: T; ms: number; maxDelayMs: number; p99DelayMs: number }> {
  const h = monitorEventLoopDelay({ resolution: 1 });
  let last = performance.now();
  let maxGap = 0;
  const gaps: [number, number][] = [];
  const timer = setInterval(() => {
    const now = performance.now();
    if (now - last > 30 && process.env.SCALE_GAPS) gaps.push([Math.round(last), Math.round(now - last)]);
    maxGap = Math.max(maxGap, now - last); last = now;
  }, 1);
  h.enable();
  const t0 = performance.now();
  try {
    const value = await fn();
    const ms = performance.now() - t0;
    maxGap = Math.max(maxGap, performance.now() - last);
    if (gaps.length) log(`    gaps over 30 ms (at ms since start, ms): ${JSON.stringify(gaps.slice(0, 20))}`);
    return { value, ms, maxDelayMs: Math.max(0, maxGap - 1), p99DelayMs: h.percentile(99) / 1e6 };
  } finally {
    clearInterval(timer);
    h.disable();
  }
}

interface SizeResult {
  asked: number;
  extents: number;
  buildS: number;
  commits: number;
  rssMiB: number;
  heapMiB: number;
  arrayBuffersMiB: number;
  /** Heap plus ArrayBuffer memory per extent. */
  bytesPerExtent: number;
  heapBytesPerExtent: number;
  checkpoint: { ms: number; bytes: number; maxDelayMs: number; p99DelayMs: number };
  recovery: { ms: number; extents: number; maxDelayMs: number; p99DelayMs: number };
  compactionPlan: { ms: number; maxDelayMs: number; p99DelayMs: number };
  serving: { reads: number; usPerRead: number; maxDelayMs: number; p99DelayMs: number };
}

type Catalogs = () => StoreCatalog;

async function oneSize(asked: number, root: string): Promise<SizeResult> {
  const dir = path.join(root, `x${asked}`);
  const store = openStore(`file:${path.join(dir, 'store')}`);
  const cat: Catalogs = () => new StoreCatalog({ store, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 64 * MiB }), volume: { checkpointEvery: 1e9 } });
  // The writer's part in a function of its own: once it returns, nothing of the first volume
  // stays reachable (its map would double the heap a new host recovers into).
  const built = await buildAndCheckpoint(asked, store, cat);
  gc();

  // Recovery on a new host: a new catalog, nothing of the volume in memory.
  const rec = await withDelay(async () => (await cat().open('v', { readOnly: true })).backend as Volume);
  const w = rec.value;
  log(`  recovery: ${fmt(rec.ms)} ms (${w.stats().extents.toLocaleString('en-US')} extents), event loop delay max ${fmt(rec.maxDelayMs)} ms`);
  const plan = await withDelay(() => w.compactionCandidates(0.5));
  log(`  compaction planning: ${fmt(plan.ms)} ms, event loop delay max ${fmt(plan.maxDelayMs)} ms`);
  // Serving: random 4 KiB reads, each resolved through the map (most land on zero extents or
  // gaps, one in DATA_EVERY written extents on a data object read from its file).
  const rnd = seededRandom(SEED + asked + 1);
  const buf = Buffer.alloc(4096);
  const serve = await withDelay(async () => {
    for (let i = 0; i < READS; i++) {
      await w.read(Math.floor(rnd() * (TiB / 4096)) * 4096, 4096, buf);
      // A request arriving from a socket is its own event-loop turn: a read of a zero extent
      // resolves in microtasks only, so without this the loop would never turn (the whole
      // phase would show as one delay).
      await new Promise<void>((resolve) => setImmediate(resolve));
    }
  });
  log(`  serving: ${READS} random 4 KiB reads, ${fmt((serve.ms * 1000) / READS)} µs each, event loop delay max ${fmt(serve.maxDelayMs)} ms, p99 ${fmt(serve.p99DelayMs)} ms`);
  const recExtents = w.stats().extents;
  await w.close();
  await store.close();
  fs.rmSync(dir, { recursive: true, force: true });
  return {
    asked, ...built,
    recovery: { ms: rec.ms, extents: recExtents, maxDelayMs: rec.maxDelayMs, p99DelayMs: rec.p99DelayMs },
    compactionPlan: { ms: plan.ms, maxDelayMs: plan.maxDelayMs, p99DelayMs: plan.p99DelayMs },
    serving: { reads: READS, usPerRead: (serve.ms * 1000) / READS, maxDelayMs: serve.maxDelayMs, p99DelayMs: serve.p99DelayMs },
  };
}

async function buildAndCheckpoint(asked: number, store: ObjectStore, cat: Catalogs): Promise<Omit<SizeResult, 'asked' | 'recovery' | 'compactionPlan' | 'serving'>> {
  const catalog = cat();
  await catalog.create('v', TiB);
  const v = (await catalog.open('v', { readOnly: false })).backend as Volume;
  gc();
  const base = process.memoryUsage();
  const rnd = seededRandom(SEED + asked);
  const blocks = TiB / 4096;
  const data = Buffer.alloc(4096);
  const t0 = performance.now();
  for (let i = 0; i < asked; i++) {
    const off = Math.floor(rnd() * blocks) * 4096;
    if (i % DATA_EVERY === 0) {
      for (let k = 0; k < 4096; k += 4) data.writeUInt32LE(Math.floor(rnd() * 2 ** 32), k);
      await v.write(off, data, false);
    } else {
      await v.zero(off, 4096, { fua: false, mayTrim: false, fastZero: false });
    }
    if ((i + 1) % FLUSH_EVERY === 0) await v.flush();
    if ((i + 1) % 1_000_000 === 0) log(`    ${(i + 1).toLocaleString('en-US')} operations, ${v.stats().extents.toLocaleString('en-US')} extents, ${((performance.now() - t0) / 1000).toFixed(0)} s`);
  }
  await v.flush();
  const buildS = (performance.now() - t0) / 1000;
  const extents = v.stats().extents;
  gc();
  const mem = process.memoryUsage();
  const rssMiB = (mem.rss - base.rss) / MiB;
  const heapMiB = (mem.heapUsed - base.heapUsed) / MiB;
  const arrayBuffersMiB = (mem.arrayBuffers - base.arrayBuffers) / MiB;
  log(`  ${extents.toLocaleString('en-US')} extents built in ${buildS.toFixed(1)} s (${v.stats().commits} commits); +${fmt(rssMiB)} MiB RSS, +${fmt(heapMiB)} MiB heap, +${fmt(arrayBuffersMiB)} MiB array buffers`);

  // Checkpoint: forced, then wait until it is in the store.
  const cpPrefix = `vol/${v.volumeId}/checkpoint/`;
  const cpsBefore = new Set((await listAll(store, cpPrefix)).map((o) => o.key));
  const internals = v as unknown as { maybeCheckpoint(force: boolean): void; checkpointing: Promise<void> | null };
  const cp = await withDelay(async () => {
    internals.maybeCheckpoint(true);
    await internals.checkpointing;
  });
  const newCp = (await listAll(store, cpPrefix)).filter((o) => !cpsBefore.has(o.key));
  const cpBytes = newCp.reduce((n, o) => n + o.size, 0);
  if (newCp.length !== 1) throw new Error(`expected one new checkpoint, found ${newCp.length}`);
  log(`  checkpoint: ${fmt(cp.ms)} ms, ${formatSize(cpBytes)}, event loop delay max ${fmt(cp.maxDelayMs)} ms, p99 ${fmt(cp.p99DelayMs)} ms`);
  const commits = v.stats().commits;
  await v.close();
  return {
    extents, buildS, commits, rssMiB, heapMiB, arrayBuffersMiB, bytesPerExtent: ((heapMiB + arrayBuffersMiB) * MiB) / extents, heapBytesPerExtent: (heapMiB * MiB) / extents,
    checkpoint: { ms: cp.ms, bytes: cpBytes, maxDelayMs: cp.maxDelayMs, p99DelayMs: cp.p99DelayMs },
  };
}

async function main(): Promise<void> {
  const machine = machineInfo();
  const started = Date.now();
  log(`scale: EXTENTS=${EXTENTS.join(',')} DATA_EVERY=${DATA_EVERY} FLUSH_EVERY=${FLUSH_EVERY}; ${machine.nproc} cores, node ${machine.node}${(globalThis as { gc?: unknown }).gc ? '' : ' (no --expose-gc: memory rows are rough)'}`);
  const root = makeTempDir('baton-scale-');
  const results: SizeResult[] = [];
  try {
    for (const n of EXTENTS) {
      log(`  ${n.toLocaleString('en-US')} extents asked:`);
      results.push(await oneSize(n, root));
    }
  } finally {
    fs.rmSync(root, { recursive: true, force: true });
  }
  const L: string[] = [];
  L.push('# scale: maps of many extents\n');
  L.push(`${new Date(started).toISOString().slice(0, 16).replace('T', ' ')} UTC, ${machine.nproc} cores, node ${machine.node}, baton ${machine.batonCommit ?? '?'}; whole run ${((Date.now() - started) / 1000).toFixed(0)} s.`);
  L.push(`A 1 TiB volume on a \`file:\` store; random 4 KiB-aligned offsets, one in ${DATA_EVERY} a 4 KiB write of random bytes, the rest 4 KiB WRITE_ZEROES (NO_HOLE), a flush every ${FLUSH_EVERY.toLocaleString('en-US')} operations, all through the engine (Volume.write / zero / flush). Event loop delay: the longest gap of a 1 ms timer in the same process (what a host serving other volumes meanwhile sees) and monitorEventLoopDelay's p99. Memory: growth of the JS heap plus ArrayBuffer memory (where the packed committed map keeps its extents) over the build, after a full GC. Serving: ${READS.toLocaleString('en-US')} random 4 KiB reads one after the other on the recovered volume.\n`);
  L.push(markdownTable(
    ['extents', 'build, s', 'memory per extent (heap + array buffers), B', 'of it heap, B', 'RSS growth, MiB', 'checkpoint, ms', 'checkpoint size', 'delay max / p99 while checkpointing, ms', 'recovery on a new host, ms', 'delay max / p99 while recovering, ms', 'compaction planning, ms', 'delay max while planning, ms', 'random 4 KiB read, µs', 'delay max / p99 while serving reads, ms'],
    results.map((r) => [
      r.extents.toLocaleString('en-US'), fmt(r.buildS), fmt(r.bytesPerExtent), fmt(r.heapBytesPerExtent), fmt(r.rssMiB), fmt(r.checkpoint.ms), formatSize(r.checkpoint.bytes),
      `${fmt(r.checkpoint.maxDelayMs)} / ${fmt(r.checkpoint.p99DelayMs)}`, fmt(r.recovery.ms), `${fmt(r.recovery.maxDelayMs)} / ${fmt(r.recovery.p99DelayMs)}`, fmt(r.compactionPlan.ms), fmt(r.compactionPlan.maxDelayMs),
      fmt(r.serving.usPerRead), `${fmt(r.serving.maxDelayMs)} / ${fmt(r.serving.p99DelayMs)}`,
    ]),
  ));
  L.push('\n```sh\nnode --expose-gc --max-old-space-size=8192 dist/bench/scale.js   # EXTENTS=10k,1M,10M (or SCENARIOS=scale npm run bench)\n```\n');
  const out = writeResults('scale', L.join('\n'), { machine, knobs: { EXTENTS, READS, DATA_EVERY, FLUSH_EVERY, SEED }, results });
  log(`results: ${out.md}, ${out.json}`);
}

await main();
