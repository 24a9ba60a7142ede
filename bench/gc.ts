/**
 * Space amplification after a churn workload, with garbage collection and compaction: how
 * many bytes the store holds for a volume, relative to the data the volume maps, after an
 * agent-workspace-like write pattern, and what GC and compaction bring that down to.
 *
 * One variant per compaction threshold in BELOW (0.5, 0.8), each on its own fresh store
 * (so GC numbers are for one volume), each running the same seeded workload:
 *
 *   fill     a SIZE (2 GiB) volume gets LIVE (512 MiB) of data as file-like extents of
 *            log-uniform sizes 4 KiB .. 4 MiB, placed at random free offsets, flushed in
 *            groups of log-uniform FLUSH (512 KiB .. 16 MiB) (an fsync-ing filesystem);
 *   churn    until CHURN x LIVE (3x) more bytes are written: overwrite a random extent
 *            (70 % of those whole, same size, new content; 30 % a random part of it), delete
 *            one (TRIM) or create one elsewhere, keeping the live data within 2 % of LIVE;
 *            same flush groups; then close (the writer leaves a checkpoint);
 *   gc       two collectGarbage runs G apart (the first marks, the second deletes), after
 *            waiting G so everything the churn freed is old enough; no compaction;
 *   compact  a new writer (takeover), Volume.compact({ below }), close (checkpoint);
 *   gc       two runs G apart again.
 * After each step: live bytes (the map's non-zero extents; cross-checked against the model
 * and catalog.listWithAccounting().writtenBytes) and the bytes listed under vol/<id>/ (by
 * kind: segments, log records, checkpoints, meta; and by how live each data object is).
 * After each GC pass the whole volume is read back through a fresh catalog with an empty
 * cache (every byte from the store) and compared with the content model; any difference
 * fails the run.
 *
 * M (maxOperationMs) is MAX_OP_MS (1000 ms) for the catalog, the volumes and GC; the grace G
 * is 2M. GC's clock is the store's (file mtimes; radosgw's Last-Modified), so the bench
 * sleeps real time between runs.
 *
 * Knobs (environment): SIZE (2G), LIVE (512M, or SIZE/4 if smaller), CHURN (3), SEED (1),
 * FLUSH (512K-16M: the range flush group sizes are drawn from, log-uniform), BELOW (0.5,0.8),
 * MAX_OP_MS (1000), RGW (1 when radosgw is installed and we are root; 0 skips: the same
 * workload again on radosgw, scripts/rgw.sh, loopback, memstore), RGW_BELOW (the thresholds
 * run there: the first of BELOW; "all").
 * Results: bench/results/gc.md (tables) and gc.json (everything).
 */

import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { BlockCache } from '../src/cache.js';
import { StoreUnavailableError } from '../src/errors.js';
import { makeLogger, silentLogger } from '../src/log.js';
import { formatSize, parseSize } from '../src/size.js';
import { seededRandom } from '../src/store/decorators.js';
import { LocalDirObjectStore } from '../src/store/local-dir.js';
import { listAll, type ObjectStore } from '../src/store/object-store.js';
import { openStore } from '../src/store/open.js';
import { StoreCatalog } from '../src/volume/catalog.js';
import { collectGarbage, type GcResult } from '../src/volume/gc.js';
import type { CompactionResult, Volume } from '../src/volume/volume.js';
import {
  MiB, REPO_ROOT, envNumber, envSize, fmt, has, machineInfo, makeTempDir, markdownTable, startRgwBucket, writeResults, type RgwServer,
} from './lib.js';

const BLOCK = 4096;
const SIZE = envSize('SIZE', '2G');
// SIZE is shared with other scenarios under run.sh (SIZE=256M npm run bench): LIVE follows it unless set.
const LIVE = process.env.LIVE ? envSize('LIVE', '512M') : Math.min(512 * MiB, Math.floor(SIZE / 4 / BLOCK) * BLOCK);
const CHURN = envNumber('CHURN', 3);
const SEED = Math.floor(envNumber('SEED', 1));
const BELOW = (process.env.BELOW || '0.5,0.8').split(',').map((s) => Number(s.trim())).filter((x) => x > 0 && x <= 1);
const M = Math.max(1, Math.floor(envNumber('MAX_OP_MS', 1000)));
const G = 2 * M;
const RGW = (process.env.RGW ?? '1') !== '0' && process.getuid?.() === 0 && has('radosgw');
/** Thresholds run on radosgw (the space numbers are the same as on file:, the workload is seeded): the first of BELOW unless set; 'all' for every one. */
const RGW_BELOW = (process.env.RGW_BELOW || String(BELOW[0] ?? 0.5)) === 'all' ? BELOW : (process.env.RGW_BELOW || String(BELOW[0] ?? 0.5)).split(',').map((x) => Number(x.trim())).filter((x) => x > 0 && x <= 1);
const MIN_EXTENT = 1; // blocks
const MAX_EXTENT = 1024; // blocks: 4 MiB
const [FLUSH_MIN, FLUSH_MAX] = (process.env.FLUSH || '512K-16M').split('-').map((x) => parseSize(x.trim())) as [number, number];
if (!(FLUSH_MIN > 0 && FLUSH_MAX >= FLUSH_MIN)) throw new Error(`FLUSH=${process.env.FLUSH}: expected MIN-MAX, e.g. 512K-16M`);
const GOAL = 1.25;
const BUCKET = 'bench';
const randomSuffix = randomBytes(3).toString('hex');

if (BELOW.length === 0) throw new Error('BELOW: no threshold in (0, 1]');
if (LIVE > SIZE / 2) throw new Error(`LIVE (${formatSize(LIVE)}) must be at most half of SIZE (${formatSize(SIZE)}): the churn needs free space to place new extents`);

const log = (s: string): void => { process.stderr.write(s + '\n'); };
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

// ------------------------------------------------------------------ seeded randomness and content

function mix(a: number, b: number): number {
  let h = Math.imul(a ^ 0x9e3779b1, 0x85ebca6b) ^ Math.imul(b + 0x7f4a7c15, 0xc2b2ae35);
  h ^= h >>> 16;
  h = Math.imul(h, 0x7feb352d);
  h ^= h >>> 15;
  return h >>> 0;
}

/** 64 MiB of seeded random bytes: every block's content is a slice of it, stamped with (block, serial). */
const POOL_BYTES = 64 * MiB;
function makePool(seed: number): Buffer {
  const r = seededRandom(seed ^ 0x5eed);
  const b = Buffer.allocUnsafe(POOL_BYTES + BLOCK);
  for (let i = 0; i < b.length; i += 4) b.writeUInt32LE(Math.floor(r() * 4294967296), i);
  return b;
}

/** The content of volume block `b` as written by write number `serial` (incompressible, unique per block and write). */
function blockContent(pool: Buffer, b: number, serial: number, out: Buffer, at: number): void {
  const off = (mix(serial, b) % (POOL_BYTES / 16)) * 16;
  pool.copy(out, at, off, off + BLOCK);
  out.writeUInt32LE(b, at);
  out.writeUInt32LE(serial, at + 4);
}

// ------------------------------------------------------------------ the workload model

interface WorkloadStats {
  fillSeconds: number;
  churnSeconds: number;
  writtenBytes: number;
  fillBytes: number;
  churnBytes: number;
  trimmedBytes: number;
  ops: { create: number; overwriteWhole: number; overwritePart: number; delete: number };
  flushes: number;
  flushRetries: number;
  commits: number;
  lastSeq: number;
  extents: number;
}

/**
 * What the volume should contain: per 4 KiB block, the serial number of the write that last
 * wrote it (0: never written or trimmed). Extents are the "files": their blocks are placed
 * in free space, overwritten, trimmed.
 */
class Model {
  readonly blocks: number;
  readonly serial: Uint32Array;
  private readonly owner: Int32Array;
  private starts: number[] = [];
  private lens: number[] = [];
  private live: number[] = []; // extent ids
  private livePos: number[] = [];
  private nextSerial = 1;
  liveBlocks = 0;

  constructor(size: number, private readonly rnd: () => number) {
    this.blocks = Math.floor(size / BLOCK);
    this.serial = new Uint32Array(this.blocks);
    this.owner = new Int32Array(this.blocks).fill(-1);
  }

  /** Log-uniform 1 .. 1024 blocks (4 KiB .. 4 MiB). */
  drawExtentBlocks(): number {
    return Math.min(MAX_EXTENT, Math.max(MIN_EXTENT, Math.floor(Math.exp(this.rnd() * Math.log(MAX_EXTENT + 1)))));
  }

  private isFree(start: number, n: number): boolean {
    for (let i = start; i < start + n; i++) if (this.owner[i] !== -1) return false;
    return true;
  }

  /** A free run of n blocks at a random place (random probes, then a scan from a random point). */
  private allocate(n: number): number | null {
    for (let t = 0; t < 64; t++) {
      const s = Math.floor(this.rnd() * (this.blocks - n + 1));
      if (this.isFree(s, n)) return s;
    }
    const from = Math.floor(this.rnd() * this.blocks);
    for (let k = 0; k < this.blocks; k++) {
      const s = (from + k) % (this.blocks - n + 1);
      if (this.isFree(s, n)) return s;
    }
    return null;
  }

  get extentCount(): number { return this.live.length; }

  create(): { start: number; n: number; serial: number } {
    let n = this.drawExtentBlocks();
    let s = this.allocate(n);
    while (s === null && n > 1) { n = Math.max(1, n >> 1); s = this.allocate(n); }
    if (s === null) throw new Error('volume full');
    const id = this.starts.length;
    this.starts.push(s);
    this.lens.push(n);
    this.livePos[id] = this.live.length;
    this.live.push(id);
    this.owner.fill(id, s, s + n);
    this.liveBlocks += n;
    return this.stamp(s, n);
  }

  private pick(): number {
    return this.live[Math.floor(this.rnd() * this.live.length)]!;
  }

  overwrite(part: boolean): { start: number; n: number; serial: number } {
    const id = this.pick();
    let s = this.starts[id]!;
    let n = this.lens[id]!;
    if (part && n > 1) {
      const k = Math.max(1, Math.floor(Math.exp(this.rnd() * Math.log(n)))); // log-uniform part
      s += Math.floor(this.rnd() * (n - k + 1));
      n = k;
    }
    return this.stamp(s, n);
  }

  remove(): { start: number; n: number } {
    const id = this.pick();
    const s = this.starts[id]!;
    const n = this.lens[id]!;
    const pos = this.livePos[id]!;
    const last = this.live.pop()!;
    if (last !== id) { this.live[pos] = last; this.livePos[last] = pos; }
    this.owner.fill(-1, s, s + n);
    this.serial.fill(0, s, s + n);
    this.liveBlocks -= n;
    return { start: s, n };
  }

  private stamp(s: number, n: number): { start: number; n: number; serial: number } {
    const serial = this.nextSerial++;
    this.serial.fill(serial, s, s + n);
    return { start: s, n, serial };
  }
}

function renderBlocks(pool: Buffer, start: number, n: number, serial: number): Buffer {
  const buf = Buffer.allocUnsafe(n * BLOCK); // >= 4 KiB: its own ArrayBuffer (the volume keeps it until the commit)
  for (let i = 0; i < n; i++) blockContent(pool, start + i, serial, buf, i * BLOCK);
  return buf;
}

/** A flush that fails with a transient store error leaves the data dirty: flush again (counted; none expected on a local store). */
async function flushRetrying(v: Volume, stats: { flushRetries: number }): Promise<void> {
  for (let attempt = 0; ; attempt++) {
    try {
      await v.flush();
      return;
    } catch (err) {
      if (!(err instanceof StoreUnavailableError) || attempt >= 20) throw err;
      stats.flushRetries++;
      if (stats.flushRetries <= 5) log(`    flush retried: ${(err as Error).message}`);
    }
  }
}

async function runWorkload(catalog: StoreCatalog, name: string, model: Model, pool: Buffer, rnd: () => number, token: number): Promise<WorkloadStats> {
  const st: WorkloadStats = {
    fillSeconds: 0, churnSeconds: 0, writtenBytes: 0, fillBytes: 0, churnBytes: 0, trimmedBytes: 0,
    ops: { create: 0, overwriteWhole: 0, overwritePart: 0, delete: 0 }, flushes: 0, flushRetries: 0, commits: 0, lastSeq: 0, extents: 0,
  };
  const ov = await catalog.open(name, { readOnly: false });
  const v = ov.volume!;
  await v.takeover(token);
  const drawFlush = (): number => Math.floor(Math.exp(Math.log(FLUSH_MIN) + rnd() * (Math.log(FLUSH_MAX) - Math.log(FLUSH_MIN))));
  let sinceFlush = 0;
  let flushAt = drawFlush();
  const afterOp = async (bytes: number): Promise<void> => {
    sinceFlush += bytes;
    if (sinceFlush >= flushAt) {
      await flushRetrying(v, st);
      st.flushes++;
      sinceFlush = 0;
      flushAt = drawFlush();
    }
  };
  const write = async (w: { start: number; n: number; serial: number }): Promise<number> => {
    await v.write(w.start * BLOCK, renderBlocks(pool, w.start, w.n, w.serial), false);
    st.writtenBytes += w.n * BLOCK;
    return w.n * BLOCK;
  };

  let t0 = performance.now();
  let nextReport = 64 * MiB;
  while (model.liveBlocks * BLOCK < LIVE) {
    st.ops.create++;
    const b = await write(model.create());
    st.fillBytes += b;
    await afterOp(b);
    if (st.fillBytes >= nextReport) { log(`    fill: ${formatSize(st.fillBytes)} (${(st.fillBytes / MiB / ((performance.now() - t0) / 1000)).toFixed(0)} MiB/s)`); nextReport += 128 * MiB; }
  }
  await flushRetrying(v, st);
  st.flushes++;
  sinceFlush = 0;
  st.fillSeconds = (performance.now() - t0) / 1000;
  log(`    fill: ${formatSize(st.fillBytes)} in ${model.extentCount} extents, ${st.fillSeconds.toFixed(1)} s`);

  t0 = performance.now();
  const churnTarget = CHURN * LIVE;
  nextReport = 256 * MiB;
  while (st.churnBytes < churnTarget) {
    const ratio = (model.liveBlocks * BLOCK) / LIVE;
    const r = rnd();
    let op: 'create' | 'delete' | 'overwrite';
    if (ratio > 1.02) op = 'delete';
    else if (ratio < 0.98) op = 'create';
    else op = r < 0.7 ? 'overwrite' : r < 0.85 ? 'delete' : 'create';
    if (model.extentCount < 2 && op === 'delete') op = 'create';
    let bytes = 0;
    if (op === 'create') {
      st.ops.create++;
      bytes = await write(model.create());
    } else if (op === 'overwrite') {
      const part = rnd() < 0.3;
      if (part) st.ops.overwritePart++; else st.ops.overwriteWhole++;
      bytes = await write(model.overwrite(part));
    } else {
      st.ops.delete++;
      const d = model.remove();
      await v.trim(d.start * BLOCK, d.n * BLOCK, false);
      st.trimmedBytes += d.n * BLOCK;
    }
    st.churnBytes += bytes;
    await afterOp(bytes);
    if (st.churnBytes >= nextReport) { log(`    churn: ${formatSize(st.churnBytes)} of ${formatSize(churnTarget)} (${(st.churnBytes / MiB / ((performance.now() - t0) / 1000)).toFixed(0)} MiB/s)`); nextReport += 256 * MiB; }
  }
  await flushRetrying(v, st);
  st.flushes++;
  st.churnSeconds = (performance.now() - t0) / 1000;
  st.commits = v.stats().commits;
  st.lastSeq = v.lastCommittedSeq;
  st.extents = v.stats().extents;
  await ov.close();
  log(`    churn: ${formatSize(st.churnBytes)} written, ${formatSize(st.trimmedBytes)} trimmed, ${st.churnSeconds.toFixed(1)} s; ${st.commits} commits, log at ${st.lastSeq}, ${st.flushRetries} flush retries`);
  return st;
}

// ------------------------------------------------------------------ measuring

interface KindBytes { objects: number; bytes: number }
interface Measure {
  stage: string;
  seconds: number;
  liveBytes: number;
  modelLiveBytes: number;
  accountedWrittenBytes: number;
  storedBytes: number;
  storedObjects: number;
  amplification: number;
  /** file: only: bytes the object files take on disk (each has a 4 KiB header, plus filesystem rounding). */
  onDiskBytes: number | null;
  byKind: Record<'seg' | 'log' | 'checkpoint' | 'meta' | 'other', KindBytes>;
  /** Data objects (segments and log records with data) by live fraction; log records without mapped data count as 'dead'. */
  byLiveFraction: Record<'dead' | 'lt50' | 'lt80' | 'ge80', KindBytes>;
  /** Bytes of log records that map no live data (takeovers, records after the checkpoint, the newest, garbage). */
  logNoDataBytes: number;
  /** Everything else in the store (gc/marks, gc/clock, volumes/). */
  outsideVolBytes: number;
}

function kindOf(key: string): 'seg' | 'log' | 'checkpoint' | 'meta' | 'other' {
  if (/\/seg\//.test(key)) return 'seg';
  if (/\/log\//.test(key)) return 'log';
  if (/\/checkpoint\//.test(key)) return 'checkpoint';
  if (key.endsWith('/meta')) return 'meta';
  return 'other';
}

function diskUsage(dir: string): number {
  let n = 0;
  const walk = (d: string): void => {
    let entries: fs.Dirent[];
    try { entries = fs.readdirSync(d, { withFileTypes: true }); } catch { return; }
    for (const e of entries) {
      const p = path.join(d, e.name);
      if (e.isDirectory()) walk(p);
      else if (e.isFile()) { try { n += fs.statSync(p).blocks * 512; } catch { /* deleted meanwhile */ } }
    }
  };
  walk(dir);
  return n;
}

async function measure(stage: string, catalog: StoreCatalog, name: string, id: string, model: Model, diskDir: string | null): Promise<Measure> {
  const t0 = performance.now();
  const view = await catalog.loadMap(name);
  const liveByKey = new Map<string, number>();
  let live = 0;
  for (const e of view.committedExtents()) {
    if (e.key === null) continue;
    live += e.length;
    liveByKey.set(e.key, (liveByKey.get(e.key) ?? 0) + e.length);
  }
  await view.close();
  const acc = (await catalog.listWithAccounting()).find((x) => x.name === name);
  const objs = await listAll(catalog.store, `vol/${id}/`);
  const all = await listAll(catalog.store, '');
  const byKind: Measure['byKind'] = { seg: { objects: 0, bytes: 0 }, log: { objects: 0, bytes: 0 }, checkpoint: { objects: 0, bytes: 0 }, meta: { objects: 0, bytes: 0 }, other: { objects: 0, bytes: 0 } };
  const byLive: Measure['byLiveFraction'] = { dead: { objects: 0, bytes: 0 }, lt50: { objects: 0, bytes: 0 }, lt80: { objects: 0, bytes: 0 }, ge80: { objects: 0, bytes: 0 } };
  let stored = 0;
  let logNoData = 0;
  for (const o of objs) {
    stored += o.size;
    const k = kindOf(o.key);
    byKind[k].objects++;
    byKind[k].bytes += o.size;
    if (k !== 'seg' && k !== 'log') continue;
    const l = liveByKey.get(o.key) ?? 0;
    if (k === 'log' && l === 0) logNoData += o.size;
    const f = o.size > 0 ? l / o.size : 0;
    const b = l === 0 ? 'dead' : f < 0.5 ? 'lt50' : f < 0.8 ? 'lt80' : 'ge80';
    byLive[b].objects++;
    byLive[b].bytes += o.size;
  }
  const outside = all.filter((o) => !o.key.startsWith(`vol/${id}/`)).reduce((n, o) => n + o.size, 0);
  const m: Measure = {
    stage, seconds: (performance.now() - t0) / 1000, liveBytes: live, modelLiveBytes: model.liveBlocks * BLOCK, accountedWrittenBytes: acc?.writtenBytes ?? NaN,
    storedBytes: stored, storedObjects: objs.length, amplification: live > 0 ? stored / live : NaN,
    onDiskBytes: diskDir ? diskUsage(path.join(diskDir, 'vol', id)) : null, byKind, byLiveFraction: byLive, logNoDataBytes: logNoData, outsideVolBytes: outside,
  };
  if (m.liveBytes !== m.modelLiveBytes || m.accountedWrittenBytes !== m.liveBytes) {
    throw new Error(`${stage}: live bytes disagree: map ${m.liveBytes}, model ${m.modelLiveBytes}, listWithAccounting ${m.accountedWrittenBytes}`);
  }
  log(`    ${stage}: live ${formatSize(live)}, stored ${formatSize(stored)} in ${objs.length} objects = ${m.amplification.toFixed(2)}x` +
    ` (seg ${formatSize(byKind.seg.bytes)}, log ${formatSize(byKind.log.bytes)}, checkpoints ${byKind.checkpoint.objects}/${formatSize(byKind.checkpoint.bytes)})`);
  return m;
}

// ------------------------------------------------------------------ verification

/** Read the whole volume through a fresh catalog (new store client, empty cache: every byte from the store) and compare with the model. */
async function verify(makeStore: () => ObjectStore, name: string, model: Model, pool: Buffer): Promise<{ seconds: number; bytesRead: number; liveBlocksChecked: number }> {
  const t0 = performance.now();
  const store = makeStore();
  const cache = BlockCache.open({ capacityBytes: 32 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: M } });
  const ov = await catalog.open(name, { readOnly: true });
  const WINDOW = 8 * MiB;
  const wb = WINDOW / BLOCK;
  const expected = Buffer.alloc(WINDOW);
  const zero = Buffer.alloc(BLOCK);
  let bad = 0;
  let firstBad = -1;
  let liveChecked = 0;
  try {
    for (let b0 = 0; b0 < model.blocks; b0 += wb) {
      const n = Math.min(wb, model.blocks - b0);
      const got = await ov.backend.read(b0 * BLOCK, n * BLOCK);
      for (let i = 0; i < n; i++) {
        const s = model.serial[b0 + i]!;
        const g = got.subarray(i * BLOCK, (i + 1) * BLOCK);
        let ok: boolean;
        if (s === 0) ok = g.equals(zero);
        else {
          blockContent(pool, b0 + i, s, expected, 0);
          ok = g.equals(expected.subarray(0, BLOCK));
          liveChecked++;
        }
        if (!ok) { bad++; if (firstBad < 0) firstBad = b0 + i; }
      }
    }
  } finally {
    await ov.close();
    await (await cache).close();
    await store.close();
  }
  if (bad > 0) throw new Error(`VERIFY FAILED: ${bad} of ${model.blocks} blocks of ${name} read back wrong (first at offset ${firstBad * BLOCK})`);
  return { seconds: (performance.now() - t0) / 1000, bytesRead: model.blocks * BLOCK, liveBlocksChecked: liveChecked };
}

// ------------------------------------------------------------------ GC passes

interface GcRun { ms: number; result: GcResult }
interface GcPass { waitedMs: number; mark: GcRun; delete: GcRun }

async function gcPass(catalog: StoreCatalog, margin: number): Promise<GcPass> {
  const run = async (): Promise<GcRun> => {
    const t = performance.now();
    const result = await collectGarbage(catalog, { graceMs: G, maxOperationMs: M });
    return { ms: performance.now() - t, result };
  };
  // Wait G first: what the last step freed is then old enough to be marked by the first run.
  await sleep(G + margin);
  const mark = await run();
  await sleep(G + margin);
  const del = await run();
  log(`    gc: run 1 ${mark.ms.toFixed(0)} ms, marked ${mark.result.markedObjects} (${formatSize(mark.result.markedBytes)}), deleted ${mark.result.deletedObjects}; ` +
    `run 2 ${del.ms.toFixed(0)} ms, deleted ${del.result.deletedObjects} (${formatSize(del.result.deletedBytes)}), marked ${del.result.markedObjects}, young ${del.result.youngUnreferenced}`);
  return { waitedMs: 2 * (G + margin), mark, delete: del };
}

// ------------------------------------------------------------------ one variant

interface VariantResult {
  store: string;
  below: number;
  workload: WorkloadStats;
  measures: Measure[];
  gcOnly: GcPass;
  compaction: CompactionResult & { seconds: number; error?: string };
  gcAfterCompaction: GcPass;
  verify: { afterGc: Awaited<ReturnType<typeof verify>>; afterCompaction: Awaited<ReturnType<typeof verify>> };
  seconds: number;
}

interface StoreUnderTest {
  label: string;
  /** A fresh client for the variant's store (called again for verification). */
  make(variant: string): ObjectStore;
  /** file: the directory, for on-disk usage. */
  diskDir(variant: string): string | null;
  /** Extra wait between GC runs (clock granularity of the store's timestamps). */
  marginMs: number;
}

async function runVariant(s: StoreUnderTest, below: number, work: string): Promise<VariantResult> {
  const t0 = performance.now();
  const variant = `below-${below}`;
  const store = s.make(variant);
  const cacheDir = path.join(work, `cache-${s.label.replace(/\W/g, '')}-${variant}`);
  const cache = BlockCache.open({ dir: cacheDir, capacityBytes: 256 * MiB });
  // Warnings (a failed background commit, a slow upload) go to stderr; BATON_LOG_LEVEL=info shows more.
  const catalog = new StoreCatalog({ store, log: makeLogger(process.env.BATON_LOG_LEVEL || 'warn'), cache: () => cache, volume: { maxOperationMs: M } });
  const name = 'ws';
  const rnd = seededRandom(SEED);
  const pool = makePool(SEED);
  const model = new Model(SIZE, rnd);
  await catalog.create(name, SIZE);
  const id = (await catalog.record(name)).id;
  let token = 0;
  const measures: Measure[] = [];
  const diskDir = s.diskDir(variant);

  log(`  ${s.label}, compaction below ${below}: volume ${formatSize(SIZE)}, ${formatSize(LIVE)} live, churn ${CHURN}x`);
  const workload = await runWorkload(catalog, name, model, pool, rnd, ++token);
  measures.push(await measure('after churn, before GC', catalog, name, id, model, diskDir));

  const gcOnly = await gcPass(catalog, s.marginMs);
  measures.push(await measure('after GC (no compaction)', catalog, name, id, model, diskDir));
  const v1 = await verify(() => s.make(variant), name, model, pool);
  log(`    verified after GC: ${formatSize(v1.bytesRead)} read from the store in ${v1.seconds.toFixed(1)} s, correct`);

  const c0 = performance.now();
  const ov = await catalog.open(name, { readOnly: false });
  const v = ov.volume!;
  await v.takeover(++token);
  let compaction: VariantResult['compaction'];
  try {
    const r = await v.compact({ below });
    compaction = { ...r, seconds: 0 };
  } catch (err) {
    // A failed commit leaves the data dirty: flush it and report the failure.
    log(`    compaction failed: ${(err as Error).message}; flushing what it buffered`);
    const retries = { flushRetries: 0 };
    await flushRetrying(v, retries);
    compaction = { objects: NaN, objectBytes: NaN, rewrittenBytes: NaN, seconds: 0, error: (err as Error).message };
  }
  await ov.close();
  compaction.seconds = (performance.now() - c0) / 1000;
  log(`    compaction (below ${below}): ${compaction.objects} objects of ${formatSize(compaction.objectBytes)}, ${formatSize(compaction.rewrittenBytes)} rewritten, ${compaction.seconds.toFixed(1)} s`);
  measures.push(await measure(`after compaction (below ${below}), before GC`, catalog, name, id, model, diskDir));

  const gcAfterCompaction = await gcPass(catalog, s.marginMs);
  measures.push(await measure(`after compaction (below ${below}) + GC`, catalog, name, id, model, diskDir));
  const v2 = await verify(() => s.make(variant), name, model, pool);
  log(`    verified after compaction + GC: ${formatSize(v2.bytesRead)} in ${v2.seconds.toFixed(1)} s, correct`);

  await (await cache).close();
  await store.close();
  fs.rmSync(cacheDir, { recursive: true, force: true });
  return { store: s.label, below, workload, measures, gcOnly, compaction, gcAfterCompaction, verify: { afterGc: v1, afterCompaction: v2 }, seconds: (performance.now() - t0) / 1000 };
}

// ------------------------------------------------------------------ report

const amp = (x: number): string => (Number.isFinite(x) ? `${x.toFixed(2)}×` : '–');
const mib = (b: number | null | undefined): string => (b === null || b === undefined || !Number.isFinite(b) ? '–' : fmt(b / MiB));

function render(r: { machine: ReturnType<typeof machineInfo>; durationS: number; loadavgAtEnd: number[]; variants: VariantResult[]; errors: { step: string; error: string }[]; rgw: string | null; command: string }): string {
  const m = r.machine;
  const L: string[] = [];
  L.push('# GC: space amplification after a churn workload', '');
  L.push(`${m.date.slice(0, 16).replace('T', ' ')} UTC on \`${m.hostname}\`: ${m.nproc} cores (${m.cpuModel}), ${m.memTotalGiB} GiB RAM, ${m.kernel}; **load average ${m.loadavgAtStart.join(' ')} at start, ${r.loadavgAtEnd.join(' ')} at end** (a shared machine: times are noisy, byte counts are not).`);
  L.push(`node ${m.node}; baton ${m.batonCommit ?? '?'} (working tree as built). Whole run ${r.durationS.toFixed(0)} s. Temp dir ${m.tmpdir} (${m.tmpdirFs ?? '?'}).`);
  L.push(`Knobs: SIZE=${formatSize(SIZE)}, LIVE=${formatSize(LIVE)}, CHURN=${CHURN}, SEED=${SEED}, FLUSH=${formatSize(FLUSH_MIN)}-${formatSize(FLUSH_MAX)}, BELOW=${BELOW.join(',')}, MAX_OP_MS=${M} (grace G = ${G} ms), RGW=${RGW ? 1 : 0}${RGW ? ` (RGW_BELOW=${RGW_BELOW.join(',')})` : ''}.`, '');
  L.push('Command:', '', '```sh', r.command, '```', '');

  if (r.variants.length) {
    const goals: string[][] = [];
    for (const v of r.variants) {
      const last = v.measures[v.measures.length - 1]!;
      goals.push([`stored ÷ live after compaction (below ${v.below}) + GC, ${v.store}`, amp(last.amplification), `≤ ${GOAL.toFixed(2)}×`, last.amplification <= GOAL ? '✓' : '✗']);
    }
    for (const v of r.variants) {
      const gcOnly = v.measures[1]!;
      goals.push([`stored ÷ live after GC alone (no compaction), ${v.store}, variant ${v.below}`, amp(gcOnly.amplification), `≤ ${GOAL.toFixed(2)}×`, gcOnly.amplification <= GOAL ? '✓' : '✗']);
    }
    L.push('## Goal', '', markdownTable(['measure', 'this run', 'goal', ''], goals, ['l', 'r', 'l', 'l']));

    L.push('## Space', '');
    L.push('"live": bytes the volume maps to data (its map\'s non-zero extents; equal to the model\'s and to `listWithAccounting().writtenBytes` at every step, checked). "stored": the sizes of every object listed under `vol/<id>/` (what S3 would bill). "on disk": what those object files take on the `file:` store\'s filesystem (each file has a 4 KiB header, plus block rounding). The whole volume was read back and compared byte for byte after each GC pass (fresh catalog, empty cache): correct.', '');
    const rows: string[][] = [];
    for (const v of r.variants) {
      for (const x of v.measures) {
        rows.push([v.store, String(v.below), x.stage, mib(x.liveBytes), mib(x.storedBytes), String(x.storedObjects), amp(x.amplification), mib(x.onDiskBytes),
          `${mib(x.byKind.seg.bytes)} / ${mib(x.byKind.log.bytes)} / ${fmt(x.byKind.checkpoint.bytes / 1024)} KiB (${x.byKind.checkpoint.objects})`,
          `${mib(x.byLiveFraction.dead.bytes)} / ${mib(x.byLiveFraction.lt50.bytes)} / ${mib(x.byLiveFraction.lt80.bytes)} / ${mib(x.byLiveFraction.ge80.bytes)}`]);
      }
    }
    L.push(markdownTable(['store', 'variant (below)', 'step', 'live MiB', 'stored MiB', 'objects', 'stored ÷ live', 'on disk MiB', 'segments / log records MiB / checkpoints', 'data objects by live fraction, MiB: 0 / <50 % / 50–80 % / ≥80 %'], rows, ['l', 'r', 'l', 'r', 'r', 'r', 'r', 'r', 'r', 'r']));
    L.push('The steps before compaction are the same operations on the same bytes in every variant (seeded): their rows repeat.', '');

    L.push('## GC and compaction', '');
    L.push(`Each GC pass: wait G + margin, run 1 (marks unreferenced objects older than G), wait G + margin, run 2 (deletes what run 1 marked and is still unreferenced). A run's time includes its M/2 (${M / 2} ms) wait for forks in creation. Compaction: a new writer (takeover), \`Volume.compact({ below })\`, close (checkpoint); write amplification = rewritten ÷ live.`, '');
    const g: string[][] = [];
    for (const v of r.variants) {
      for (const [label, p] of [['GC alone', v.gcOnly], [`GC after compaction (below ${v.below})`, v.gcAfterCompaction]] as const) {
        g.push([v.store, label, fmt(p.mark.ms), `${p.mark.result.markedObjects} / ${mib(p.mark.result.markedBytes)}`, fmt(p.delete.ms),
          `${p.delete.result.deletedObjects} / ${mib(p.delete.result.deletedBytes)}`, `${p.delete.result.referencedObjects} / ${mib(p.delete.result.referencedBytes)}`,
          `${p.delete.result.markedObjects} / ${p.delete.result.youngUnreferenced}`]);
      }
    }
    L.push(markdownTable(['store', 'pass', 'run 1 ms', 'run 1 marked (objects / MiB)', 'run 2 (deleting) ms', 'run 2 deleted (objects / MiB)', 'referenced after (objects / MiB)', 'run 2 newly marked / young'], g, ['l', 'l', 'r', 'r', 'r', 'r', 'r', 'r']));
    const c: string[][] = r.variants.map((v) => {
      const live = v.measures[1]!.liveBytes;
      return [v.store, String(v.below), v.compaction.error ? `failed: ${v.compaction.error}` : `${v.compaction.objects} / ${mib(v.compaction.objectBytes)}`, mib(v.compaction.rewrittenBytes),
        amp(v.compaction.rewrittenBytes / live), fmt(v.compaction.seconds)];
    });
    L.push(markdownTable(['store', 'below', 'objects rewritten (count / MiB)', 'live bytes rewritten, MiB', 'write amplification (rewritten ÷ live)', 'compaction s (open + compact + close)'], c, ['l', 'r', 'r', 'r', 'r', 'r']));

    L.push('## Workload', '');
    L.push(`Fill ${formatSize(LIVE)} as extents of log-uniform size 4 KiB – 4 MiB at random free offsets, then churn until ${CHURN}× that is written: overwrite a random extent (70 % whole, 30 % a log-uniform part), delete one (TRIM) or create one, keeping live data within 2 % of ${formatSize(LIVE)}. Flush after each log-uniform ${formatSize(FLUSH_MIN)} – ${formatSize(FLUSH_MAX)} of writes (a flush under the 8 MiB segment size is one log record with the data inline; larger ones upload 8 MiB segments first). Content: incompressible, unique per 4 KiB block and write. Same seed for every variant: the same operations and bytes.`, '');
    const w: string[][] = r.variants.map((v) => {
      const x = v.workload;
      return [v.store, String(v.below), `${mib(x.fillBytes)} in ${fmt(x.fillSeconds)} s`, `${mib(x.churnBytes)} in ${fmt(x.churnSeconds)} s`, mib(x.trimmedBytes),
        `${x.ops.create} / ${x.ops.overwriteWhole} / ${x.ops.overwritePart} / ${x.ops.delete}`, `${x.flushes} / ${x.commits} / ${x.flushRetries}`, String(x.extents), fmt(v.seconds)];
    });
    L.push(markdownTable(['store', 'variant', 'fill MiB', 'churn MiB', 'trimmed MiB', 'ops: create / overwrite whole / part / delete', 'flushes / commits / flush retries', 'map extents at end', 'variant s'], w, ['l', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r']));
    if (r.rgw) L.push(`radosgw: ${r.rgw}.`, '');
  }
  if (r.errors.length) L.push('## Errors', '', ...r.errors.map((e) => `- ${e.step}: ${e.error}`), '');
  return L.join('\n');
}

// ------------------------------------------------------------------ main

const machine = machineInfo();
const started = performance.now();
const work = makeTempDir('baton-bench-gc-');
const errors: { step: string; error: string }[] = [];
const variants: VariantResult[] = [];
let rgwVersion: string | null = null;
const knobs = { SIZE, LIVE, CHURN, SEED, FLUSH: [FLUSH_MIN, FLUSH_MAX], BELOW, MAX_OP_MS: M, GRACE_MS: G, RGW, RGW_BELOW };
const command = [...Object.entries({ SIZE: process.env.SIZE, LIVE: process.env.LIVE, CHURN: process.env.CHURN, SEED: process.env.SEED, FLUSH: process.env.FLUSH, BELOW: process.env.BELOW, MAX_OP_MS: process.env.MAX_OP_MS, RGW: process.env.RGW, RGW_BELOW: process.env.RGW_BELOW })
  .filter(([, v]) => v !== undefined && v !== '').map(([k, v]) => `${k}=${v}`), 'node', path.relative(REPO_ROOT, process.argv[1] ?? 'dist/bench/gc.js')].join(' ');
// An await that can never settle (nothing left on the event loop) ends node with code 13 and no
// stack: say where to look instead of exiting silently.
process.on('exit', (code) => {
  if (code === 13) process.stderr.write('gc bench: the event loop ran dry while a step was still waiting (exit 13): an engine bug, please report it with the seed\n');
});
log(`gc bench: ${machine.nproc} cores, load ${machine.loadavgAtStart.join(' ')}, temp dir ${work}`);

const fileStore: StoreUnderTest = {
  label: 'file:',
  make: (variant) => new LocalDirObjectStore(path.join(work, `file-${variant}`)),
  diskDir: (variant) => path.join(work, `file-${variant}`),
  marginMs: 300,
};
for (const below of BELOW) {
  try {
    variants.push(await runVariant(fileStore, below, work));
  } catch (e) {
    log(`  file:, below ${below}: ERROR ${(e as Error).stack ?? String(e)}`);
    errors.push({ step: `file: below ${below}`, error: (e as Error).message });
  }
  fs.rmSync(path.join(work, `file-below-${below}`), { recursive: true, force: true });
}

if (RGW) {
  let rgw: RgwServer | null = null;
  try {
    const started = await startRgwBucket(path.join(work, 'rgw'), BUCKET);
    rgw = started.rgw;
    rgwVersion = started.version;
    const { credentials } = started;
    const endpoint = started.rgw.endpoint;
    const s3Store: StoreUnderTest = {
      label: 'radosgw',
      make: (variant) => openStore(`s3://${BUCKET}/gc-${variant}-${randomSuffix}`, { endpoint, credentials }),
      diskDir: () => null,
      marginMs: 1100, // Last-Modified has 1 s resolution
    };
    for (const below of RGW_BELOW) {
      try {
        variants.push(await runVariant(s3Store, below, work));
      } catch (e) {
        log(`  radosgw, below ${below}: ERROR ${(e as Error).stack ?? String(e)}`);
        errors.push({ step: `radosgw below ${below}`, error: (e as Error).message });
      }
    }
  } catch (e) {
    log(`  radosgw: ERROR ${(e as Error).stack ?? String(e)}`);
    errors.push({ step: 'radosgw', error: (e as Error).message });
  } finally {
    await rgw?.stop();
  }
}

const report = {
  machine, loadavgAtEnd: os.loadavg().map((x) => Math.round(x * 100) / 100), durationS: (performance.now() - started) / 1000,
  knobs, command, rgw: rgwVersion, variants, errors,
};
const out = writeResults('gc', render(report), report);
log(`gc bench: ${out.md}, ${out.json} (${report.durationS.toFixed(0)} s)`);
if (errors.length) process.exitCode = 1;
