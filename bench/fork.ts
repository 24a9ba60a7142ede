/**
 * Forks: what `baton fork` costs, and what a long ancestry costs a reader. Two steps:
 *
 *   fork     a source volume of each size in FORK_SIZES (1 GiB and 1 TiB) with WRITTEN bytes
 *            (256 MiB) written as 64 flushed commits spread evenly over the volume (so it has
 *            a log, a checkpoint and a map of 64 extents), then REPEAT (10) forks of it:
 *            - in process, `StoreCatalog.fork` over a counting store: wall time and the store
 *              requests it made (by operation);
 *            - `baton fork SRC DST --json`, as a user runs it: the time baton reports (store
 *              opened to record written) and the wall time of the whole process (node start);
 *            on each store: `file:` (the local default); the same with LATENCY_MS (20) added
 *            to every store request (an S3-like round trip, FaultyObjectStore, in process
 *            only); and radosgw (scripts/rgw.sh, loopback, memstore) when it is installed.
 *   latency  a root volume (RLAT_SIZE, 1 GiB) with RLAT_DATA (256 MiB) of random data, then a
 *            chain of DEPTH (50) forks, each generation served by `baton serve` and written
 *            (qemu-io: 4 KiB at its own offset, flush). Then, on the same server and warm
 *            cache: fio --ioengine=nbd --rw=randread --bs=4k --iodepth=1 over the data, root
 *            and deepest alternating, PASSES (3) x RUNTIME (10) s each: latency p50/mean/p99
 *            and the ratio deepest / root; and the time to open each (first READ answered
 *            after the server had closed it: lease, recovery, takeover).
 *
 * Knobs (environment): STEPS (fork,latency), FORK_SIZES (1G,1T), WRITTEN (256M), REPEAT (10),
 * LATENCY_MS (20; 0 skips), RGW (1 when radosgw is installed and we are root; 0 skips),
 * DEPTH (50), RLAT_SIZE (1G), RLAT_DATA (256M), RUNTIME (10), PASSES (3).
 * Results: bench/results/fork.md (tables) and fork.json (every sample, every command).
 */

import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { BlockCache } from '../src/cache.js';
import { silentLogger } from '../src/log.js';
import { formatSize, parseSize } from '../src/size.js';
import { FaultyObjectStore, InstrumentedObjectStore, type StoreStats } from '../src/store/decorators.js';
import { LocalDirObjectStore } from '../src/store/local-dir.js';
import type { ByteRange, DeleteOptions, ListOptions, LocalObjects, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from '../src/store/object-store.js';
import { openStore } from '../src/store/open.js';
import { StoreCatalog } from '../src/volume/catalog.js';
import {
  BATON_BIN, MiB, REPO_ROOT, envNumber, envSize, fmt, fmtRatio, has, machineInfo, makeRandomFile, makeTempDir, markdownTable, median, nbdReadOnce,
  limitGoal, ratio, runCommand, runFio, runNbdcopy, shellQuote, startBaton, startRgwBucket, writeResults, type FioResult, type GoalRow, type RgwServer,
} from './lib.js';

const STEPS = new Set((process.env.STEPS || 'fork,latency').split(',').map((s) => s.trim()).filter(Boolean));
const FORK_SIZES = (process.env.FORK_SIZES || '1G,1T').split(',').map((s) => s.trim()).filter(Boolean);
const WRITTEN = envSize('WRITTEN', '256M');
const REPEAT = Math.max(1, Math.floor(envNumber('REPEAT', 10)));
const LATENCY_MS = envNumber('LATENCY_MS', 20);
const RGW = (process.env.RGW ?? '1') !== '0' && process.getuid?.() === 0 && has('radosgw');
const DEPTH = Math.max(1, Math.floor(envNumber('DEPTH', 50)));
const RLAT_SIZE = envSize('RLAT_SIZE', '1G');
const RLAT_DATA = envSize('RLAT_DATA', '256M');
const RUNTIME = envNumber('RUNTIME', 10);
const PASSES = Math.max(1, Math.floor(envNumber('PASSES', 3)));
const CHUNKS = 64;
const BUCKET = 'bench';

const log = (s: string): void => { process.stderr.write(s + '\n'); };
const commands: { step: string; argv: string[] }[] = [];

// ------------------------------------------------------------------ fork time

interface StoreUnderTest {
  label: string;
  /** The store the in-process catalog uses (wrapped in a counter). */
  store: ObjectStore;
  /** `--store` URL and environment for the CLI; null: in process only. */
  cli: { url: string; env: NodeJS.ProcessEnv } | null;
}

interface ForkSample { ms: number; requests: number; rounds: number; byOp: Record<string, number>; listedItems: number; putBytes: number }
interface CliSample { reportedMs: number; wallMs: number }
interface ForkRow {
  store: string;
  size: number;
  written: number;
  sourceSeq: number;
  prepareSeconds: number;
  inProcess: ForkSample[];
  cli: CliSample[];
}

function opCounts(s: StoreStats): Record<string, number> {
  const out: Record<string, number> = {};
  for (const op of ['get', 'put', 'head', 'list', 'delete'] as const) if (s[op].requests > 0) out[op] = s[op].requests;
  return out;
}

/**
 * Counts the store round trips an operation waited for one after the other: each request's
 * issue and completion times are noted; a request's chain is 1 + the longest chain among the
 * requests that completed before it was issued (what it could have waited for), and the
 * operation's round trips are the longest chain. Requests sent together count once.
 */
class RoundTrips implements ObjectStore {
  readonly description: string;
  /** The local store's in-place reads and puts pass by (no fork makes them). */
  readonly local?: LocalObjects;
  private spans: { issued: number; done: number }[] = [];
  constructor(private readonly inner: ObjectStore) {
    this.description = inner.description;
    if (inner.local) this.local = inner.local;
  }
  reset(): void { this.spans = []; }
  rounds(): number {
    const sorted = [...this.spans].sort((a, b) => a.done - b.done);
    const chain: number[] = [];
    for (let i = 0; i < sorted.length; i++) {
      let best = 0;
      for (let j = 0; j < i; j++) if (sorted[j]!.done <= sorted[i]!.issued) best = Math.max(best, chain[j]!);
      chain.push(best + 1);
    }
    return Math.max(0, ...chain);
  }
  private async timed<T>(p: () => Promise<T>): Promise<T> {
    const span = { issued: performance.now(), done: Infinity };
    this.spans.push(span);
    try { return await p(); } finally { span.done = performance.now(); }
  }
  get(key: string, range?: ByteRange): Promise<Buffer> { return this.timed(() => this.inner.get(key, range)); }
  put(key: string, body: Buffer, options?: PutOptions): Promise<void> { return this.timed(() => this.inner.put(key, body, options)); }
  head(key: string): Promise<ObjectHead | null> { return this.timed(() => this.inner.head(key)); }
  delete(key: string, options?: DeleteOptions): Promise<void> { return this.timed(() => this.inner.delete(key, options)); }
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    const span = { issued: performance.now(), done: Infinity };
    this.spans.push(span);
    try { yield* this.inner.list(prefix, options); } finally { span.done = performance.now(); }
  }
  close(): Promise<void> { return this.inner.close(); }
}

/** A source volume of `size` with WRITTEN bytes in CHUNKS flushed commits spread over it. */
async function makeSource(catalog: StoreCatalog, name: string, size: number): Promise<number> {
  await catalog.create(name, size);
  const ov = await catalog.open(name, { readOnly: false });
  const v = ov.volume!;
  await v.takeover(1);
  const chunk = Math.floor(WRITTEN / CHUNKS / 4096) * 4096;
  const stride = Math.floor(size / CHUNKS / 4096) * 4096;
  for (let i = 0; i < CHUNKS; i++) {
    await v.write(i * stride, randomBytes(chunk), false);
    await v.flush();
  }
  const seq = v.lastCommittedSeq;
  await ov.close();
  return seq;
}

/**
 * The same forks while `baton serve` has the source attached and fio writes to it with a FLUSH
 * after every 4 KiB write: the fork point moves with every commit and the source's log grows.
 */
async function forkUnderLoad(s: StoreUnderTest, catalog: StoreCatalog, counted: InstrumentedObjectStore, probe: RoundTrips, src: string, size: number, seq: number): Promise<ForkRow> {
  const dir = makeTempDir('baton-bench-fork-live-');
  const server = await startBaton({ dir, volume: src, size, store: s.cli!.url, create: false });
  commands.push({ step: 'fork under load', argv: server.argv });
  const row: ForkRow = { store: `${s.label} source written meanwhile`, size, written: WRITTEN, sourceSeq: seq, prepareSeconds: 0, inProcess: [], cli: [] };
  try {
    const runtime = Math.ceil(3 + REPEAT * 0.3);
    const fio = runFio({ name: 'load', rw: 'randwrite', bs: '4k', iodepth: 1, fsync: 1, runtime, size: Math.min(size, 1024 * MiB), ioengine: 'nbd', uri: server.uri }, dir);
    fio.catch(() => {});
    await new Promise((r) => setTimeout(r, 1500));
    for (let i = 0; i < REPEAT; i++) {
      counted.reset();
      probe.reset();
      const f0 = performance.now();
      const info = await catalog.fork(src, `${src}-l${i}`);
      const ms = performance.now() - f0;
      const st = counted.stats();
      row.inProcess.push({ ms, requests: st.total.requests, rounds: probe.rounds(), byOp: opCounts(st), listedItems: st.list.items, putBytes: st.put.bytes });
      row.sourceSeq = info.parent?.seq ?? row.sourceSeq;
      await new Promise((r) => setTimeout(r, 200));
    }
    const f = await fio;
    commands.push({ step: 'fork under load', argv: f.argv });
    log(`  ${s.label}, ${formatSize(size)}, source being written (fio ${f.iops.toFixed(0)} write+flush/s): fork median ${median(row.inProcess.map((x) => x.ms)).toFixed(1)} ms, ${row.inProcess.map((x) => x.requests).join('/')} requests, fork point now log record ${row.sourceSeq}`);
  } finally {
    await server.stop();
  }
  return row;
}

async function forkStep(stores: StoreUnderTest[]): Promise<ForkRow[]> {
  const rows: ForkRow[] = [];
  for (const s of stores) {
    const probe = new RoundTrips(s.store);
    const counted = new InstrumentedObjectStore(probe);
    const cacheDir = makeTempDir('baton-bench-fork-cache-');
    const cache = BlockCache.open({ dir: cacheDir, capacityBytes: 512 * MiB });
    const catalog = new StoreCatalog({ store: counted, log: silentLogger(), cache: () => cache });
    for (const sizeText of FORK_SIZES) {
      const size = parseSize(sizeText);
      const src = `src-${sizeText.toLowerCase()}`;
      const t0 = performance.now();
      const seq = await makeSource(catalog, src, size);
      const prepareSeconds = (performance.now() - t0) / 1000;
      log(`  ${s.label}, ${formatSize(size)}: source written (${formatSize(WRITTEN)} in ${CHUNKS} commits, log record ${seq}) in ${prepareSeconds.toFixed(1)} s`);
      const row: ForkRow = { store: s.label, size, written: WRITTEN, sourceSeq: seq, prepareSeconds, inProcess: [], cli: [] };
      for (let i = 0; i < REPEAT; i++) {
        counted.reset();
        probe.reset();
        const f0 = performance.now();
        await catalog.fork(src, `${src}-p${i}`);
        const ms = performance.now() - f0;
        const st = counted.stats();
        row.inProcess.push({ ms, requests: st.total.requests, rounds: probe.rounds(), byOp: opCounts(st), listedItems: st.list.items, putBytes: st.put.bytes });
      }
      if (s.cli) {
        for (let i = 0; i < REPEAT; i++) {
          const argv = [process.execPath, BATON_BIN, 'fork', src, `${src}-c${i}`, '--store', s.cli.url, '--json'];
          if (i === 0) commands.push({ step: `fork (${s.label})`, argv });
          const r = await runCommand(argv, { env: { ...process.env, ...s.cli.env } });
          row.cli.push({ reportedMs: (JSON.parse(r.stdout) as { ms: number }).ms, wallMs: r.seconds * 1000 });
        }
      }
      const m = median(row.inProcess.map((x) => x.ms));
      log(`  ${s.label}, ${formatSize(size)}: fork median ${m.toFixed(1)} ms in process, ${row.inProcess[0]!.requests} requests ${JSON.stringify(row.inProcess[0]!.byOp)} in ${row.inProcess[0]!.rounds} round trips` +
        (row.cli.length ? `; CLI reports ${median(row.cli.map((x) => x.reportedMs)).toFixed(0)} ms, process ${median(row.cli.map((x) => x.wallMs)).toFixed(0)} ms` : ''));
      rows.push(row);
      if (s.label === 'file:' && has('fio')) rows.push(await forkUnderLoad(s, catalog, counted, probe, src, size, seq));
    }
    await (await cache).close();
  }
  return rows;
}

// ------------------------------------------------------------------ read latency, root vs deep

interface OpenSample { openMs: number; firstReadMs: number }
interface LatencyResult {
  depth: number;
  chainSeconds: number;
  forkMs: number[];
  passes: { root: FioResult; deep: FioResult; order: string }[];
  open: { root: OpenSample[]; deep: OpenSample[] };
  correct: boolean;
}

async function latencyStep(dir: string): Promise<LatencyResult> {
  const server = await startBaton({ dir, volume: 'g0', size: RLAT_SIZE, store: 'file:', extraArgs: ['--idle-grace', '0.3'] });
  commands.push({ step: 'latency', argv: server.argv });
  try {
    const src = makeRandomFile(RLAT_DATA, 'baton-bench-fork-data-');
    const copy = await runNbdcopy(src.path, server.uri, RLAT_DATA, { flush: true });
    commands.push({ step: 'latency', argv: copy.argv });
    log(`  root: ${formatSize(RLAT_DATA)} written in ${copy.seconds.toFixed(1)} s`);
    const uri = (name: string): string => server.uri.replace('/g0?', `/${name}?`);
    // Forks touch no data: this catalog never opens a volume, so its cache stays unused.
    const cache = BlockCache.open({ capacityBytes: 16 * MiB });
    const catalog = new StoreCatalog({ store: new LocalDirObjectStore(path.join(dir, 'store')), log: silentLogger(), cache: () => cache });
    const stride = Math.floor(RLAT_DATA / (DEPTH + 1) / 4096) * 4096;
    const t0 = performance.now();
    const forkMs: number[] = [];
    for (let g = 1; g <= DEPTH; g++) {
      const f0 = performance.now();
      await catalog.fork(`g${g - 1}`, `g${g}`);
      forkMs.push(performance.now() - f0);
      const argv = ['qemu-io', '-f', 'raw', '-c', `write -P ${g % 256} ${g * stride} 4k`, '-c', 'flush', uri(`g${g}`)];
      if (g === 1) commands.push({ step: 'latency (each generation)', argv });
      await runCommand(argv, { timeoutMs: 60_000 });
    }
    const chainSeconds = (performance.now() - t0) / 1000;
    log(`  chain of ${DEPTH} generations in ${chainSeconds.toFixed(1)} s (fork median ${median(forkMs).toFixed(1)} ms)`);

    // Correctness of what is measured: the deepest reads the root's data and every generation's block.
    const checks = ['-r', '-f', 'raw', '-c', `read -P ${DEPTH % 256} ${DEPTH * stride} 4k`, '-c', `read -P 1 ${stride} 4k`, uri(`g${DEPTH}`)];
    const chk = await runCommand(['qemu-io', ...checks]);
    const want = fs.readFileSync(src.path).subarray(0, 4096);
    const got = (await nbdReadOnce(server.socket, `g${DEPTH}`, 0, 4096)).data;
    const correct = !/Pattern verification failed/.test(chk.stdout + chk.stderr) && got.equals(want);
    if (!correct) log('  WARNING: the deepest fork does not read what its ancestry wrote');

    // Warm the cache for both (they share the root's objects), then let the server close them.
    for (const name of ['g0', `g${DEPTH}`]) await runCommand(['nbdcopy', uri(name), 'null:'], { timeoutMs: 600_000 });
    const open: LatencyResult['open'] = { root: [], deep: [] };
    for (let i = 0; i < 5; i++) {
      for (const [key, name] of [['root', 'g0'], ['deep', `g${DEPTH}`]] as const) {
        await new Promise((r) => setTimeout(r, 800)); // past the idle grace: the next attach opens it anew
        const r = await nbdReadOnce(server.socket, name, 4096, 4096);
        open[key].push({ openMs: r.goAt - r.connectedAt, firstReadMs: r.readAt - r.goAt });
      }
    }
    const passes: LatencyResult['passes'] = [];
    for (let p = 0; p < PASSES; p++) {
      const order = p % 2 === 0 ? ['g0', `g${DEPTH}`] : [`g${DEPTH}`, 'g0'];
      const res: Record<string, FioResult> = {};
      for (const name of order) {
        res[name] = await runFio({ name: `randread-${name}`, rw: 'randread', bs: '4k', iodepth: 1, runtime: RUNTIME, size: RLAT_DATA, ioengine: 'nbd', uri: uri(name) }, dir);
        if (p === 0 && name === 'g0') commands.push({ step: 'latency', argv: res[name]!.argv });
      }
      passes.push({ root: res.g0!, deep: res[`g${DEPTH}`]!, order: order.join(' then ') });
      log(`  pass ${p + 1}: p50 root ${res.g0!.latUs.p50.toFixed(0)} µs, deep ${res[`g${DEPTH}`]!.latUs.p50.toFixed(0)} µs; mean ${res.g0!.latUs.mean.toFixed(0)} / ${res[`g${DEPTH}`]!.latUs.mean.toFixed(0)} µs`);
    }
    return { depth: DEPTH, chainSeconds, forkMs, passes, open, correct };
  } finally {
    await server.stop();
  }
}

// ------------------------------------------------------------------ report

/** The issue's goal per store setting: a fork in under 50 ms, the worst size's median. */
function forkGoals(rows: ForkRow[] | undefined): GoalRow[] {
  const out: GoalRow[] = [];
  for (const label of [...new Set((rows ?? []).map((x) => x.store))]) {
    const mine = rows!.filter((x) => x.store === label);
    const worst = Math.max(...mine.map((x) => median(x.inProcess.map((s) => s.ms))));
    out.push(limitGoal(`fork, ${label} (median of ${REPEAT}, worst of ${mine.map((x) => formatSize(x.size)).join(', ')})`, worst, 'ms', '≤', 50, `${mine[0]!.inProcess[0]!.requests} store requests in ${mine[0]!.inProcess[0]!.rounds} round trips`));
  }
  return out;
}

function render(r: { machine: ReturnType<typeof machineInfo>; durationS: number; loadavgAtEnd: number[]; fork?: ForkRow[] | undefined; latency?: LatencyResult | undefined; errors: { step: string; error: string }[]; rgw: string | null }): string {
  const m = r.machine;
  const L: string[] = [];
  L.push('# Forks: fork time and read latency through a deep ancestry', '');
  L.push(`${m.date.slice(0, 16).replace('T', ' ')} UTC on \`${m.hostname}\`: ${m.nproc} cores (${m.cpuModel}), ${m.memTotalGiB} GiB RAM, ${m.kernel}; **load average ${m.loadavgAtStart.join(' ')} at start, ${r.loadavgAtEnd.join(' ')} at end**.`);
  L.push(`node ${m.node}; ${m.fio ?? 'no fio'}; baton ${m.batonCommit ?? '?'} (working tree as built). Whole run ${r.durationS.toFixed(0)} s. Temp dir ${m.tmpdir} (${m.tmpdirFs ?? '?'}).`);
  L.push(`Knobs: FORK_SIZES=${FORK_SIZES.join(',')}, WRITTEN=${formatSize(WRITTEN)}, REPEAT=${REPEAT}, LATENCY_MS=${LATENCY_MS}, RGW=${RGW ? 1 : 0}, DEPTH=${DEPTH}, RLAT_SIZE=${formatSize(RLAT_SIZE)}, RLAT_DATA=${formatSize(RLAT_DATA)}, RUNTIME=${RUNTIME}, PASSES=${PASSES}.`, '');

  const goals: string[][] = [];
  const labels = [...new Set((r.fork ?? []).map((x) => x.store))];
  for (const g of forkGoals(r.fork)) goals.push([`${g.goal}, in process`, g.result, g.target, g.pass ? '✓' : '✗']);
  if (labels.length) {
    const all = r.fork!;
    const reqs = new Set(all.flatMap((x) => x.inProcess.map((s) => s.requests)));
    const bytes = new Set(all.flatMap((x) => x.inProcess.map((s) => s.putBytes)));
    goals.push([`store requests per fork, every store and size (${[...new Set(all.map((x) => formatSize(x.size)))].join(', ')})`, `${[...reqs].join(', ')} (put ${[...bytes].map((b) => `${b} B`).join(', ')})`, 'flat in size', reqs.size === 1 ? '✓' : '✗']);
  }
  if (r.latency) {
    const rp = median(r.latency.passes.map((p) => p.root.latUs.p50));
    const dp = median(r.latency.passes.map((p) => p.deep.latUs.p50));
    const q = ratio(dp, rp);
    goals.push([`read latency p50, ${r.latency.depth}-deep fork ÷ root (fio 4k randread QD1)`, fmtRatio(q), '≤ 1.10×', Number.isFinite(q) ? (q <= 1.1 ? '✓' : '✗') : '–']);
  }
  if (goals.length) L.push('## Goals', '', markdownTable(['measure', 'this run', 'goal', ''], goals, ['l', 'r', 'l', 'l']));

  if (r.fork?.length) {
    L.push('## Fork time', '');
    L.push(`A source volume per size with ${formatSize(WRITTEN)} written as ${CHUNKS} flushed commits of ${formatSize(WRITTEN / CHUNKS)} spread evenly over it (its log, a checkpoint, a map of ${CHUNKS} extents), idle; then ${REPEAT} forks of it.`);
    L.push('"in process": `StoreCatalog.fork` timed around the call, store requests counted by a wrapper (a listing counts once). "CLI": `baton fork SRC DST --json` — the `ms` baton prints (timed around the same call; on `s3://` it includes loading the AWS SDK, which baton imports on first use) and the wall time of the whole process (node start-up included). "+N ms/request" adds N ms before every store request (FaultyObjectStore): a fork costs about (round trips × N) ms more, where "round trips" counts the requests it waited for one after the other (requests sent together count once; measured by a second wrapper, RoundTrips).', '');
    const rows = r.fork.map((x) => {
      const ms = x.inProcess.map((s) => s.ms);
      const s0 = x.inProcess[0]!;
      return [
        x.store, formatSize(x.size), String(x.sourceSeq), fmt(median(ms)), `${fmt(Math.min(...ms))} – ${fmt(Math.max(...ms))}`,
        `${s0.requests} (${Object.entries(s0.byOp).map(([k, v]) => `${k} ${v}`).join(', ')})`, String(s0.rounds), `${s0.listedItems} / ${fmt(s0.putBytes)} B`,
        x.cli.length ? fmt(median(x.cli.map((c) => c.reportedMs))) : '–', x.cli.length ? fmt(median(x.cli.map((c) => c.wallMs))) : '–',
      ];
    });
    L.push(markdownTable(['store', 'volume', 'source log seq', 'in process, median ms', 'min – max ms', 'store requests', 'round trips', 'objects listed / bytes put', 'CLI reported, median ms', 'CLI process wall, median ms'], rows, ['l', 'r', 'r', 'r', 'r', 'l', 'r', 'r', 'r', 'r']));
    if (r.rgw) L.push(`radosgw: ${r.rgw}.`, '');
  }

  if (r.latency) {
    const x = r.latency;
    L.push('## Read latency: root vs a fork ' + x.depth + ' generations deep', '');
    L.push(`Root: ${formatSize(RLAT_SIZE)} volume, ${formatSize(RLAT_DATA)} of random data (nbdcopy --flush). Then ${x.depth} generations, each a fork of the previous (StoreCatalog.fork, median ${fmt(median(x.forkMs))} ms), served by the same \`baton serve\` and written with qemu-io (4 KiB at its own offset, then flush): ${x.chainSeconds.toFixed(1)} s for the chain. Reads of the deepest fork are checked (${x.correct ? 'correct' : '**WRONG**'}). Both volumes read once in full first (warm cache, same objects), then fio alternating, order swapped every pass.`, '');
    const row = (label: string, pick: (f: FioResult) => number): string[] => {
      const a = median(x.passes.map((p) => pick(p.root)));
      const b = median(x.passes.map((p) => pick(p.deep)));
      return [label, fmt(a), fmt(b), fmtRatio(ratio(b, a)), x.passes.map((p) => `${fmt(pick(p.root))}/${fmt(pick(p.deep))}`).join(', ')];
    };
    L.push(markdownTable(['fio 4k randread QD1, ' + RUNTIME + ' s, median of ' + PASSES, 'root', `${x.depth} deep`, 'deep ÷ root', 'each pass (root/deep)'], [
      row('latency p50, µs ↓', (f) => f.latUs.p50),
      row('latency mean, µs ↓', (f) => f.latUs.mean),
      row('latency p99, µs ↓', (f) => f.latUs.p99),
      row('IOPS ↑', (f) => f.iops),
    ], ['l', 'r', 'r', 'r', 'l']));
    const om = (k: 'root' | 'deep', f: keyof OpenSample): number => median(x.open[k].map((s) => s[f]));
    L.push(markdownTable(['open after idle close (median of 5)', 'root', `${x.depth} deep`, 'deep ÷ root'], [
      ['OPT_GO answered (lease, recovery, takeover), ms', fmt(om('root', 'openMs')), fmt(om('deep', 'openMs')), fmtRatio(ratio(om('deep', 'openMs'), om('root', 'openMs')))],
      ['first 4 KiB READ after that, ms', fmt(om('root', 'firstReadMs')), fmt(om('deep', 'firstReadMs')), fmtRatio(ratio(om('deep', 'firstReadMs'), om('root', 'firstReadMs')))],
    ], ['l', 'r', 'r', 'r']));
  }
  if (r.errors.length) L.push('## Errors', '', ...r.errors.map((e) => `- ${e.step}: ${e.error}`), '');
  L.push('## Commands', '', '$TMP = the run\'s private temp dir, $SHM the random input file\'s (on tmpfs).', '', '```sh');
  const seen = new Set<string>();
  for (const c of commands) {
    const line = shellQuote(c.argv).replaceAll(REPO_ROOT + '/', '').replace(/\/tmp\/baton-bench-fork-[^/ ]+/g, '$TMP').replace(/\/dev\/shm\/baton-bench-fork-data-[^/ ]+/g, '$SHM');
    if (seen.has(line)) continue;
    seen.add(line);
    L.push(`# ${c.step}`, line);
  }
  L.push('```', '');
  return L.join('\n');
}

// ------------------------------------------------------------------ main

const machine = machineInfo();
const started = performance.now();
const work = makeTempDir('baton-bench-fork-');
const errors: { step: string; error: string }[] = [];
let forkRows: ForkRow[] | undefined;
let latency: LatencyResult | undefined;
let rgwVersion: string | null = null;
log(`fork bench: ${machine.nproc} cores, load ${machine.loadavgAtStart.join(' ')}, temp dir ${work}`);

if (STEPS.has('fork')) {
  log('fork:');
  let rgw: RgwServer | null = null;
  try {
    const fileDir = path.join(work, 'file-store');
    const stores: StoreUnderTest[] = [{ label: 'file:', store: new LocalDirObjectStore(fileDir), cli: { url: `file:${fileDir}`, env: {} } }];
    if (LATENCY_MS > 0) {
      stores.push({ label: `file: +${LATENCY_MS} ms/request`, store: new FaultyObjectStore(new LocalDirObjectStore(path.join(work, 'slow-store')), { latencyMs: LATENCY_MS }), cli: null });
    }
    if (RGW) {
      const started = await startRgwBucket(path.join(work, 'rgw'), BUCKET);
      rgw = started.rgw;
      rgwVersion = started.version;
      const { credentials } = started;
      const url = `s3://${BUCKET}/fork`;
      stores.push({ label: 'radosgw', store: openStore(url, { endpoint: started.rgw.endpoint, credentials }), cli: { url, env: started.rgw.env } });
    }
    forkRows = await forkStep(stores);
    for (const s of stores) await s.store.close().catch(() => {});
  } catch (e) {
    log(`  fork: ERROR ${(e as Error).stack ?? String(e)}`);
    errors.push({ step: 'fork', error: (e as Error).message });
  } finally {
    await rgw?.stop();
  }
}

if (STEPS.has('latency')) {
  log('latency:');
  try {
    if (!has('fio') || !has('qemu-io') || !has('nbdcopy')) throw new Error('needs fio, qemu-io and nbdcopy');
    fs.mkdirSync(path.join(work, 'latency'));
    latency = await latencyStep(path.join(work, 'latency'));
  } catch (e) {
    log(`  latency: ERROR ${(e as Error).stack ?? String(e)}`);
    errors.push({ step: 'latency', error: (e as Error).message });
  }
}

const report = {
  machine, loadavgAtEnd: (await import('node:os')).loadavg().map((x) => Math.round(x * 100) / 100), durationS: (performance.now() - started) / 1000,
  knobs: { STEPS: [...STEPS], FORK_SIZES, WRITTEN, REPEAT, LATENCY_MS, RGW, DEPTH, RLAT_SIZE, RLAT_DATA, RUNTIME, PASSES },
  rgw: rgwVersion, fork: forkRows, latency, errors, commands,
};
const out = writeResults('fork', render(report), { ...report, goals: forkGoals(forkRows) });
log(`fork bench: ${out.md}, ${out.json} (${report.durationS.toFixed(0)} s)`);
if (errors.length) process.exitCode = 1;

