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
 *   recovery    Volume.open on a new catalog (a host with nothing of the volume in memory),
 *               RECOVERIES (3) times, the table showing the one with the longest delay:
 *               time, event loop delay max meanwhile;
 *   compaction  compactionCandidates (the planning walk over the whole map): time, delay max;
 *   fio         while the checkpoint and the compaction planning run, the volume is served over
 *               NBD (an in-process NbdServer on a Unix socket, as `baton serve` would) and fio
 *               reads it (randread 4 KiB, QD 4, FIO_S (4) seconds, the phase starting 0.5 s in):
 *               fio's IOPS, p99 and max latency are what a client saw meanwhile;
 *   serving     READS (20,000) random 4 KiB reads through Volume.read on the recovered volume,
 *               one at a time, each in an event-loop turn of its own (as requests from a socket
 *               are; every read resolves through the map): time per read, delay max and p99.
 *
 * The event loop's delay is measured by a 1 ms interval timer (the longest gap between two of
 * its ticks minus 1 ms) and perf_hooks' monitorEventLoopDelay (p99), both in this process,
 * which is what a host serving other volumes meanwhile would see. On a shared machine much of
 * a gap may be time the main thread waited for a CPU, or was blocked: the main thread's
 * scheduler times (/proc/thread-self/schedstat, read at every tick) say how much of each gap
 * it ran (the "cpu" number: what this process held the loop for) and waited on the run queue.
 * That wait is behind any runnable thread, this process's own GC helpers and libuv pool
 * included, so the raw maximum stays the number to meet; the others say whose a gap was.
 *
 * Knobs (environment): EXTENTS (10k,1M,10M), READS (20000), RECOVERIES (3), SCALE_PROFILE (a directory: a CPU profile of the recoveries there), FIO_S (4; 0: no fio), DATA_EVERY (100), FLUSH_EVERY (50000), SEED (1), SCALE_GAPS (1: print
 * every gap of the event loop over 30 ms with its time, to line up with node --trace-gc; a
 * number above 1: over that many ms).
 * Results: bench/results/scale.md and scale.json. Run with node --expose-gc for the memory rows
 * (bench/run.sh does).
 */

import * as fs from 'node:fs';
import * as inspector from 'node:inspector';
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
import { NbdServer } from '../nbd/server.js';
import type { BlockBackend } from '../nbd/backend.js';
import { MiB, fmt, machineInfo, makeTempDir, markdownTable, runFio, writeResults, type FioResult } from './lib.js';

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
/** Recoveries from the one checkpoint (each on a new catalog): the table shows the worst. */
const RECOVERIES = Math.max(1, Number(process.env.RECOVERIES || 3));
/** fio over NBD while checkpointing and planning: its run in seconds (0: off); the phase starts FIO_LEAD_MS into it. */
const FIO_S = Math.max(0, Number(process.env.FIO_S ?? 4));
const FIO_LEAD_MS = 500;
/** SCALE_PROFILE=DIR: a CPU profile of the recoveries (inspector, 100 µs samples) in DIR. */
const PROFILE_DIR = process.env.SCALE_PROFILE || '';
/** SCALE_GAPS=1: print event-loop gaps over 30 ms; SCALE_GAPS=N (> 1): over N ms. */
const GAPS_MS = !process.env.SCALE_GAPS ? 0 : Number(process.env.SCALE_GAPS) > 1 ? Number(process.env.SCALE_GAPS) : 30;
const log = (s: string): void => { process.stderr.write(s + '\n'); };
const gc = (): void => { (globalThis as { gc?: () => void }).gc?.(); };

/**
 * The main thread's scheduler times (Linux /proc/thread-self/schedstat): ns on a CPU and ns
 * waiting for one on the run queue. The machine these benches run on is shared: an event
 * loop gap during which the main thread waited for a CPU is another process's doing, and the
 * wait is what tells them apart. Null where there is no schedstat.
 */
const schedstat = ((): (() => [number, number]) | null => {
  let fd: number;
  try { fd = fs.openSync('/proc/thread-self/schedstat', 'r'); } catch { return null; }
  const buf = Buffer.alloc(128);
  return () => {
    const n = fs.readSync(fd, buf, 0, buf.length, 0);
    const [run, wait] = buf.toString('latin1', 0, n).split(' ');
    return [Number(run), Number(wait)];
  };
})();

interface Delay {
  maxDelayMs: number;
  p99DelayMs: number;
  /** The longest gap less the time the main thread waited for a CPU during it. */
  ownMaxDelayMs: number | null;
  /** The most CPU time the main thread used within one gap (±1 kernel tick): what this process held the loop for. */
  cpuMaxMs: number | null;
}

/**
 * The event loop's delay while `fn` runs: the longest gap of a 1 ms timer, and the delay
 * histogram's p99; `ownMaxDelayMs`, the longest gap less the time the main thread spent
 * waiting for a CPU meanwhile; and `cpuMaxMs`, the most CPU time the main thread used within
 * one gap (its JS, its GC: what this process itself held the loop for; the rest of a gap is
 * waiting for a CPU, or blocked).
 */
async function withDelay<T>(fn: () => Promise<T>): Promise<{ value: T; ms: number } & Delay> {
  const h = monitorEventLoopDelay({ resolution: 1 });
  let last = performance.now();
  let [lastRun, lastWait] = schedstat ? schedstat() : [0, 0];
  let maxGap = 0;
  let maxOwn = 0;
  let maxCpu = 0;
  const gaps: string[] = [];
  const tick = (): void => {
    const now = performance.now();
    const [run, wait] = schedstat ? schedstat() : [0, 0];
    const gap = now - last;
    const waited = (wait - lastWait) / 1e6;
    // The rest of a gap, neither on a CPU nor waiting for one, the thread was blocked (a
    // synchronous read, a page fault waiting for reclaim).
    // With a profile: where the gap began on the profile's clock (CLOCK_MONOTONIC µs), to find its samples.
    const mono = PROFILE_DIR ? ` [mono ${Math.round(Number(process.hrtime.bigint() / 1000n) - gap * 1000)} µs]` : '';
    if (GAPS_MS > 0 && gap > GAPS_MS) gaps.push(`${Math.round(last)}${mono}: ${Math.round(gap)} ms${schedstat ? ` (${Math.round((run - lastRun) / 1e6)} on a CPU, ${Math.round(waited)} waiting for one)` : ''}`);
    maxGap = Math.max(maxGap, gap);
    maxOwn = Math.max(maxOwn, gap - waited);
    maxCpu = Math.max(maxCpu, (run - lastRun) / 1e6);
    last = now;
    lastRun = run;
    lastWait = wait;
  };
  const timer = setInterval(tick, 1);
  h.enable();
  const t0 = performance.now();
  try {
    const value = await fn();
    const ms = performance.now() - t0;
    tick();
    if (gaps.length) log(`    gaps over ${GAPS_MS} ms (at ms since start): ${gaps.slice(0, 20).join(', ')}`);
    return { value, ms, maxDelayMs: Math.max(0, maxGap - 1), p99DelayMs: h.percentile(99) / 1e6, ownMaxDelayMs: schedstat ? Math.max(0, maxOwn - 1) : null, cpuMaxMs: schedstat ? maxCpu : null };
  } finally {
    clearInterval(timer);
    h.disable();
  }
}

const pick = (d: Delay): Delay => ({ maxDelayMs: d.maxDelayMs, p99DelayMs: d.p99DelayMs, ownMaxDelayMs: d.ownMaxDelayMs, cpuMaxMs: d.cpuMaxMs });
/** The delays for the log; "max / p99 (most on a CPU in one gap)" for the table. */
const delayLog = (d: Delay): string => `event loop delay max ${fmt(d.maxDelayMs)} ms, p99 ${fmt(d.p99DelayMs)} ms${d.cpuMaxMs !== null ? `; less waits for a CPU ${fmt(d.ownMaxDelayMs!)} ms, at most ${fmt(d.cpuMaxMs)} ms on a CPU in one gap` : ''}`;
const delayCell = (d: Delay): string => `${fmt(d.maxDelayMs)} / ${fmt(d.p99DelayMs)}${d.cpuMaxMs !== null ? ` (${fmt(d.cpuMaxMs)})` : ''}`;

/** What fio saw over NBD during a phase: IOPS, latency p99 and max (µs). */
interface ClientView { iops: number; p99Us: number; maxUs: number }

/**
 * Run `phase` while the volume is served over NBD and fio reads it (FIO_S seconds, the phase
 * starting FIO_LEAD_MS in): the phase's event-loop delay (withDelay) and what the client saw.
 */
async function withFio<T>(backend: BlockBackend, dir: string, name: string, phase: () => Promise<T>): Promise<{ phase: Awaited<ReturnType<typeof withDelay<T>>>; fio: ClientView | null }> {
  if (FIO_S <= 0) return { phase: await withDelay(phase), fio: null };
  const sock = path.join(dir, `${name}.sock`);
  const server = new NbdServer({
    list: async () => [{ name: 'v', description: 'scale' }],
    open: async () => ({ name: 'v', description: 'scale', backend, release: () => {} }),
  }, { log: silentLogger() });
  await server.listen({ path: sock });
  try {
    const fio = runFio({ name, rw: 'randread', bs: '4k', iodepth: 4, runtime: FIO_S, size: backend.size, ioengine: 'nbd', uri: `nbd+unix:///v?socket=${sock}`, extra: ['--randrepeat=0'] }, dir);
    fio.catch(() => {});
    await new Promise((resolve) => setTimeout(resolve, FIO_LEAD_MS));
    const measured = await withDelay(phase);
    const r: FioResult = await fio;
    const lat = (r.raw.read as { lat_ns?: { max?: number } } | undefined)?.lat_ns;
    return { phase: measured, fio: { iops: r.iops, p99Us: r.latUs.p99, maxUs: (lat?.max ?? NaN) / 1000 } };
  } finally {
    await server.close();
  }
}

const fioLog = (f: ClientView | null): string => (f ? `; fio over NBD meanwhile: ${Math.round(f.iops)} IOPS, p99 ${fmt(f.p99Us / 1000)} ms, max ${fmt(f.maxUs / 1000)} ms` : '');
const fioCell = (f: ClientView | null | undefined): string => (f ? `${Math.round(f.iops).toLocaleString('en-US')} / ${fmt(f.p99Us / 1000)} / ${fmt(f.maxUs / 1000)}` : '');

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
  checkpoint: { ms: number; bytes: number; fio: ClientView | null } & Delay;
  /** The recovery with the longest event-loop delay of RECOVERIES (maxDelaysMs: each one's). */
  recovery: { ms: number; extents: number; maxDelaysMs: number[]; releaseGcMs: number[] } & Delay;
  compactionPlan: { ms: number; fio: ClientView | null } & Delay;
  serving: { reads: number; usPerRead: number } & Delay;
}

type Catalogs = () => StoreCatalog;

/** The inspector's CPU profiler in this process, from now until stop (which writes the profile to `file`). */
async function startProfiler(): Promise<{ stop: (file: string) => Promise<string> }> {
  const session = new inspector.Session();
  session.connect();
  const post = (method: string, params?: object): Promise<unknown> => new Promise((resolve, reject) => session.post(method, params, (err, res) => (err ? reject(err) : resolve(res))));
  await post('Profiler.enable');
  await post('Profiler.setSamplingInterval', { interval: 100 });
  await post('Profiler.start');
  return {
    stop: async (file) => {
      const { profile } = (await post('Profiler.stop')) as { profile: unknown };
      session.disconnect();
      fs.mkdirSync(path.dirname(file), { recursive: true });
      fs.writeFileSync(file, JSON.stringify(profile));
      return file;
    },
  };
}

async function oneSize(asked: number, root: string): Promise<SizeResult> {
  const dir = path.join(root, `x${asked}`);
  const store = openStore(`file:${path.join(dir, 'store')}`);
  const cat: Catalogs = () => new StoreCatalog({ store, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 64 * MiB }), volume: { checkpointEvery: 1e9 } });
  // The writer's part in a function of its own: once it returns, nothing of the first volume
  // stays reachable (its map would double the heap a new host recovers into).
  const built = await buildAndCheckpoint(asked, store, cat, dir);
  // Let the writer's memory go before timing a new host: freeing its hundreds of MiB of
  // buffers (the map's pool, the checkpoint it wrote) shows as event-loop gaps of 10-50 ms
  // here, which a new host does not have. Twice, with time between: what one full GC leaves
  // to finish later (array buffers are swept after it) is done before the timing starts.
  const settle = async (): Promise<void> => {
    for (let i = 0; i < 2; i++) {
      gc();
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  };
  await settle();

  // Recovery on a new host: a new catalog, nothing of the volume in memory. RECOVERIES times
  // (the stall of one recovery is a tail on a shared machine: several samples from one build);
  // the table shows the one with the longest event-loop delay, the log every one.
  // Only the last recovered volume is kept: each holds a map of hundreds of MiB, and a host
  // that recovers a volume has let go of the ones it closed.
  const recoveries: Array<{ ms: number } & Delay> = [];
  const profiler = PROFILE_DIR ? await startProfiler() : null;
  let w: Volume | null = null;
  const releaseMs: number[] = [];
  for (let i = 0; i < RECOVERIES; i++) {
    if (w) {
      await w.close();
      w = null;
      // The GC that frees the closed volume's map (its pool pages): timed on its own, as what
      // letting go of a map costs the loop, then time for whatever V8 finishes after it.
      const t0 = performance.now();
      gc();
      releaseMs.push(performance.now() - t0);
      await settle();
    }
    const one = await withDelay(async () => (await cat().open('v', { readOnly: true })).backend as Volume);
    w = one.value;
    log(`  recovery${RECOVERIES > 1 ? ` ${i + 1} of ${RECOVERIES}` : ''}: ${fmt(one.ms)} ms (${w.stats().extents.toLocaleString('en-US')} extents), ${delayLog(one)}`);
    recoveries.push({ ms: one.ms, ...pick(one) });
  }
  if (profiler) log(`  recoveries' CPU profile: ${await profiler.stop(path.join(PROFILE_DIR, `recovery-${asked}.cpuprofile`))}`);
  const rec = recoveries.reduce((a, b) => (b.maxDelayMs > a.maxDelayMs ? b : a));
  if (!w) throw new Error('no recovery ran');
  if (releaseMs.length) log(`  a full GC right after a recovered volume closed (what freeing its map costs): ${releaseMs.map(fmt).join(', ')} ms`);
  const { phase: plan, fio: planFio } = await withFio(w, dir, 'plan', () => w.compactionCandidates(0.5));
  log(`  compaction planning: ${fmt(plan.ms)} ms, ${delayLog(plan)}${fioLog(planFio)}`);
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
  log(`  serving: ${READS} random 4 KiB reads, ${fmt((serve.ms * 1000) / READS)} µs each, ${delayLog(serve)}`);
  const recExtents = w.stats().extents;
  await w.close();
  await store.close();
  fs.rmSync(dir, { recursive: true, force: true });
  return {
    asked, ...built,
    recovery: { ms: rec.ms, extents: recExtents, ...pick(rec), maxDelaysMs: recoveries.map((r) => r.maxDelayMs), releaseGcMs: releaseMs },
    compactionPlan: { ms: plan.ms, fio: planFio, ...pick(plan) },
    serving: { reads: READS, usPerRead: (serve.ms * 1000) / READS, ...pick(serve) },
  };
}

async function buildAndCheckpoint(asked: number, store: ObjectStore, cat: Catalogs, dir: string): Promise<Omit<SizeResult, 'asked' | 'recovery' | 'compactionPlan' | 'serving'>> {
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
  const { phase: cp, fio: cpFio } = await withFio(v, dir, 'checkpoint', async () => {
    internals.maybeCheckpoint(true);
    await internals.checkpointing;
  });
  const newCp = (await listAll(store, cpPrefix)).filter((o) => !cpsBefore.has(o.key));
  const cpBytes = newCp.reduce((n, o) => n + o.size, 0);
  if (newCp.length !== 1) throw new Error(`expected one new checkpoint, found ${newCp.length}`);
  log(`  checkpoint: ${fmt(cp.ms)} ms, ${formatSize(cpBytes)}, ${delayLog(cp)}${fioLog(cpFio)}`);
  const commits = v.stats().commits;
  await v.close();
  return {
    extents, buildS, commits, rssMiB, heapMiB, arrayBuffersMiB, bytesPerExtent: ((heapMiB + arrayBuffersMiB) * MiB) / extents, heapBytesPerExtent: (heapMiB * MiB) / extents,
    checkpoint: { ms: cp.ms, bytes: cpBytes, fio: cpFio, ...pick(cp) },
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
  L.push(`A 1 TiB volume on a \`file:\` store; random 4 KiB-aligned offsets, one in ${DATA_EVERY} a 4 KiB write of random bytes, the rest 4 KiB WRITE_ZEROES (NO_HOLE), a flush every ${FLUSH_EVERY.toLocaleString('en-US')} operations, all through the engine (Volume.write / zero / flush). Event loop delay, "max / p99 (cpu)": the longest gap of a 1 ms timer in the same process (what a host serving other volumes meanwhile sees), monitorEventLoopDelay's p99, and in parentheses the most CPU time the main thread used within one gap (Linux schedstat, ±1 kernel tick: on a shared machine the rest of a gap is waiting for a CPU or blocked; scale.json also has each phase's longest gap less its run-queue waits). Memory: growth of the JS heap plus ArrayBuffer memory (where the packed committed map keeps its extents) over the build, after a full GC. Serving: ${READS.toLocaleString('en-US')} random 4 KiB reads one after the other on the recovered volume. fio: while checkpointing and while planning, the volume served over NBD on a Unix socket in this process, fio randread 4 KiB at QD 4 for ${FIO_S} s (the phase starting 0.5 s in): IOPS, latency p99 and max.\n`);
  L.push(markdownTable(
    ['extents', 'build, s', 'memory per extent (heap + array buffers), B', 'of it heap, B', 'RSS growth, MiB', 'checkpoint, ms', 'checkpoint size', 'delay while checkpointing, ms', 'fio over NBD meanwhile: IOPS / p99 / max ms', 'recovery on a new host, ms', 'delay while recovering, ms (worst of RECOVERIES; each one\'s max)', 'compaction planning, ms', 'delay while planning, ms', 'fio over NBD meanwhile: IOPS / p99 / max ms', 'random 4 KiB read, µs', 'delay while serving reads, ms'],
    results.map((r) => [
      r.extents.toLocaleString('en-US'), fmt(r.buildS), fmt(r.bytesPerExtent), fmt(r.heapBytesPerExtent), fmt(r.rssMiB), fmt(r.checkpoint.ms), formatSize(r.checkpoint.bytes),
      delayCell(r.checkpoint), fioCell(r.checkpoint.fio), fmt(r.recovery.ms), `${delayCell(r.recovery)}; ${r.recovery.maxDelaysMs.map(fmt).join(', ')}`, fmt(r.compactionPlan.ms), delayCell(r.compactionPlan), fioCell(r.compactionPlan.fio),
      fmt(r.serving.usPerRead), delayCell(r.serving),
    ]),
  ));
  L.push('\n```sh\nnode --expose-gc --max-old-space-size=8192 dist/bench/scale.js   # EXTENTS=10k,1M,10M (or SCENARIOS=scale npm run bench)\n```\n');
  const out = writeResults('scale', L.join('\n'), { machine, knobs: { EXTENTS, READS, RECOVERIES, DATA_EVERY, FLUSH_EVERY, SEED, FIO_S }, results });
  log(`results: ${out.md}, ${out.json}`);
}

await main();
