/**
 * Issue 16: framed data, compression, checksums, encryption: what they cost and what they save,
 * every setting measured by the same build in the same run.
 *
 * Volume settings (`baton create` options), all on a `file:` store served by one `baton serve`:
 *
 *   raw        --data-format raw: the layout before issue 16 (no frames, no checks): "off"
 *   crc        --compression none: frames with checksums, not compressed
 *   lz4        the default: frames with checksums, lz4
 *   lz4+enc    --encrypt: lz4 frames encrypted with AES-256-GCM
 *
 * 1. ratio: store bytes ÷ logical bytes for (a) the seed's workspace as in workspace-forks
 *    (git clone of the seed repository + npm ci of its project, test/helpers/workspace.ts),
 *    (b) a real one: `git clone` of this repository and `npm ci --offline --ignore-scripts` of
 *    its lockfile (from the npm cache), each on ext4 (nbdfuse + loop; root), and (c) SIZE of
 *    random bytes written with nbdcopy. Store bytes: every object under the volume's prefix
 *    after `baton gc` until quiet (overwritten journal blocks gone); logical: `baton ls`'s
 *    written bytes (what the map names). Also `written stored` (accounting's estimate).
 * 2. throughput: nbdcopy of SIZE bytes into a fresh volume (with its FLUSH) and back out to
 *    null:, random bytes and text (source-like, compressible), REPEAT passes, the order of the
 *    settings rotated every pass; medians and per-pass numbers.
 * 3. FLUSH: fio randwrite 4 KiB QD1 with fsync=1 for RUNTIME seconds per setting (rotated):
 *    FLUSH p50/p99.
 *
 * 2 and 3 run on the file: store and, with RGW (1, needs radosgw), on a loopback radosgw.
 * Knobs: SIZE (512M), REPEAT (3), RUNTIME (10), RGW (1), WORKSPACES (1; 0 skips part 1's
 * ext4 rows, which need root), SEED (1). Results: bench/results/frames.md and .json.
 */

import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { randomBytes } from 'node:crypto';
import { formatSize } from '../src/size.js';
import { GC_TEST_ENV, gcUntilQuiet, storeObjectBytes } from '../test/helpers/gc.js';
import { git, makeNpmProject, makeSourceRepo, npmEnv } from '../test/helpers/workspace.js';
import { rngFrom } from '../test/helpers/writer.js';
import {
  BATON_BIN, MiB, REPO_ROOT, attachExt4, envFlag, envNumber, envSize, fmt, has, limitGoal, machineInfo, makeRandomFile, makeTempDir, markdownTable, median, ratioGoal, runCommand, runFio,
  runNbdcopy, startBaton, startRgwBucket, writeResults, type GoalRow, type Server,
} from './lib.js';

const SIZE = envSize('SIZE', '512M');
const REPEAT = Math.max(1, Math.floor(envNumber('REPEAT', 3)));
const RUNTIME = Math.max(1, Math.floor(envNumber('RUNTIME', 10)));
const SEED = Math.floor(envNumber('SEED', 1)) >>> 0;
const IS_ROOT = process.getuid?.() === 0;
const RGW = envFlag('RGW', true) && has('radosgw');
const WORKSPACES = envFlag('WORKSPACES', true) && IS_ROOT && ['nbdfuse', 'losetup', 'mkfs.ext4', 'git', 'npm'].every(has);

const SETTINGS = {
  raw: ['--data-format', 'raw'],
  crc: ['--compression', 'none'],
  lz4: [],
  'lz4+enc': ['--encrypt'],
} as const satisfies Record<string, readonly string[]>;
type Setting = keyof typeof SETTINGS;
const ALL = Object.keys(SETTINGS) as Setting[];

const log = (s: string): void => { process.stderr.write(`${s}\n`); };
const since = (t: number): number => (performance.now() - t) / 1000;
const load = (): string => fs.readFileSync('/proc/loadavg', 'utf8').split(' ').slice(0, 3).join(' ');

interface Ctx { root: string; store: string; env: NodeJS.ProcessEnv; server: Server | null; n: number }

function cli(ctx: Ctx, args: string[]): string {
  const r = spawnSync(process.execPath, [BATON_BIN, ...args, '--store', ctx.store], { encoding: 'utf8', env: { ...process.env, ...ctx.env } });
  if (r.status !== 0) throw new Error(`baton ${args.join(' ')} exited ${r.status}: ${r.stderr}`);
  return r.stdout;
}

function create(ctx: Ctx, s: Setting, size: number, label: string): string {
  const name = `${label}-${s.replace('+', '-')}-${++ctx.n}`;
  cli(ctx, ['create', name, '--size', String(size), ...SETTINGS[s]]);
  return name;
}

function uri(ctx: Ctx, name: string): string { return `nbd+unix:///${name}?socket=${ctx.server!.socket}`; }

async function serve(ctx: Ctx): Promise<void> {
  ctx.server = await startBaton({ dir: ctx.root, volume: '-', size: 0, store: ctx.store, create: false, env: ctx.env, extraArgs: ['--idle-grace', '0.2', '--lease-ttl', '60', '--gc-interval', '0'] });
}

interface VolJson { name: string; writtenBytes?: number; writtenStoredBytes?: number; storedBytes: number }

/** Store bytes under a volume's prefix, and its accounting (ls --json). */
async function bytesOf(ctx: Ctx, name: string): Promise<{ store: number; written: number; writtenStored: number }> {
  const vols = JSON.parse(cli(ctx, ['ls', '--json'])) as VolJson[];
  const v = vols.find((x) => x.name === name)!;
  return { store: v.storedBytes, written: v.writtenBytes ?? NaN, writtenStored: v.writtenStoredBytes ?? NaN };
}

/** A compressible input like a source tree: this repository's text files, concatenated and repeated to `size`. */
function makeTextFile(size: number, dir: string): string {
  const files = spawnSync('git', ['-C', REPO_ROOT, 'ls-files', '*.ts', '*.md', '*.json', '*.sh'], { encoding: 'utf8' }).stdout.split('\n').filter(Boolean);
  const parts: Buffer[] = [];
  let n = 0;
  for (const f of files) { const b = fs.readFileSync(path.join(REPO_ROOT, f)); parts.push(b); n += b.length; if (n > 64 * MiB) break; }
  const one = Buffer.concat(parts);
  const file = path.join(dir, 'text.bin');
  const fd = fs.openSync(file, 'w');
  for (let done = 0; done < size;) { const k = Math.min(one.length, size - done); fs.writeSync(fd, one, 0, k); done += k; }
  fs.closeSync(fd);
  return file;
}

// ------------------------------------------------------------------ 1. ratio

interface RatioRow { workload: string; setting: Setting; written: number; writtenStored: number; storeBefore: number; storeAfterGc: number; buildS: number }

async function buildWorkspace(ctx: Ctx, kind: 'seed' | 'real', fx: { src: string; app: string; work: string }, s: Setting): Promise<RatioRow> {
  const name = create(ctx, s, 2 * 1024 * MiB, `ws-${kind}`);
  const t0 = performance.now();
  const dir = makeTempDir('baton-bench-frames-ext4-', ctx.root);
  const st = await attachExt4(uri(ctx, name), dir, { mkfs: true });
  try {
    await git(['clone', '-q', '--no-hardlinks', fx.src, path.join(st.mnt, 'repo')], undefined, 600_000);
    fs.cpSync(fx.app, path.join(st.mnt, 'app'), { recursive: true, filter: (p) => !p.includes(`${path.sep}node_modules`) });
    const env = kind === 'seed' ? { ...process.env, ...npmEnv(fx.work) } : { ...process.env, npm_config_audit: 'false', npm_config_fund: 'false', npm_config_update_notifier: 'false' };
    await runCommand(['npm', 'ci', '--offline', '--ignore-scripts', '--no-audit', '--no-fund'], { cwd: path.join(st.mnt, 'app'), env, timeoutMs: 900_000 });
    await runCommand(['sync', '-f', st.mnt], { timeoutMs: 300_000 });
  } finally {
    await st.teardown();
  }
  const buildS = since(t0);
  await new Promise((r) => setTimeout(r, 1500)); // the idle close (a checkpoint)
  const b = await bytesOf(ctx, name);
  return { workload: kind, setting: s, written: b.written, writtenStored: b.writtenStored, storeBefore: b.store, storeAfterGc: NaN, buildS };
}

async function randomRow(ctx: Ctx, s: Setting, src: string): Promise<RatioRow> {
  const name = create(ctx, s, SIZE, 'rand');
  const t0 = performance.now();
  await runNbdcopy(src, uri(ctx, name), SIZE, { flush: true });
  const buildS = since(t0);
  await new Promise((r) => setTimeout(r, 1500));
  const b = await bytesOf(ctx, name);
  return { workload: 'random', setting: s, written: b.written, writtenStored: b.writtenStored, storeBefore: b.store, storeAfterGc: NaN, buildS };
}

// ------------------------------------------------------------------ 2, 3. throughput and FLUSH

interface CopyRow { store: string; pass: number; data: 'random' | 'text'; setting: Setting; writeMiBs: number; readMiBs: number; load: string }
interface FlushRow { store: string; pass: number; setting: Setting; p50: number; p99: number; iops: number; load: string }

async function throughput(ctx: Ctx, store: string, randomPath: string, textPath: string, copies: CopyRow[], flushes: FlushRow[], loads: string[]): Promise<void> {
  // ---- 2. throughput, rotated
  for (let pass = 0; pass < REPEAT; pass++) {
    const order = ALL.map((_, i) => ALL[(i + pass) % ALL.length]!);
    for (const data of ['random', 'text'] as const) {
      for (const s of order) {
        const name = create(ctx, s, SIZE, `tp-${data}`);
        const l = load();
        const w = await runNbdcopy(data === 'random' ? randomPath : textPath, uri(ctx, name), SIZE, { flush: true });
        const r = await runNbdcopy(uri(ctx, name), 'null:', SIZE);
        copies.push({ store, pass, data, setting: s, writeMiBs: w.mibPerSec, readMiBs: r.mibPerSec, load: l });
        log(`  [${store}] pass ${pass + 1} ${data} ${s}: write ${fmt(w.mibPerSec)} MiB/s, read ${fmt(r.mibPerSec)} MiB/s (load ${l})`);
        await new Promise((res) => setTimeout(res, 400)); // idle close
        cli(ctx, ['rm', name]);
      }
    }
    // ---- 3. FLUSH latency, rotated
    for (const s of order) {
      const name = create(ctx, s, 256 * MiB, 'flush');
      const l = load();
      const f = await runFio({ name: `flush-${s.replace('+', '-')}`, rw: 'randwrite', bs: '4k', iodepth: 1, runtime: RUNTIME, size: 256 * MiB, ioengine: 'nbd', uri: uri(ctx, name), fsync: 1 }, ctx.root);
      flushes.push({ store, pass, setting: s, p50: f.syncUs?.p50 ?? NaN, p99: f.syncUs?.p99 ?? NaN, iops: f.iops, load: l });
      log(`  [${store}] pass ${pass + 1} flush ${s}: p50 ${fmt(f.syncUs?.p50)} µs, p99 ${fmt(f.syncUs?.p99)} µs, ${fmt(f.iops)} writes/s (load ${l})`);
      await new Promise((res) => setTimeout(res, 400));
      cli(ctx, ['rm', name]);
    }
    loads.push(load());
  }
}

async function main(): Promise<void> {
  for (const tool of ['nbdcopy', 'fio']) if (!has(tool)) { log(`frames: skipped: ${tool} is missing`); return; }
  const machine = machineInfo();
  const root = makeTempDir('baton-bench-frames-');
  const keyFile = path.join(root, 'master.key');
  fs.writeFileSync(keyFile, randomBytes(32), { mode: 0o600 });
  const ctx: Ctx = { root, store: `file:${path.join(root, 'store')}`, env: { ...GC_TEST_ENV, BATON_KEY_FILE: keyFile, BATON_HOME: path.join(root, 'home'), BATON_CACHE_DIR: path.join(root, 'cache') }, server: null, n: 0 };
  log(`frames bench: ${machine.nproc} cores, load ${load()}, SIZE ${formatSize(SIZE)}, REPEAT ${REPEAT}, RUNTIME ${RUNTIME} s, temp dir ${root}`);
  const randomFile = makeRandomFile(SIZE, 'baton-bench-frames-rand-');
  const textFile = makeTextFile(SIZE, path.dirname(randomFile.path));
  await serve(ctx);
  const ratio: RatioRow[] = [];
  const copies: CopyRow[] = [];
  const flushes: FlushRow[] = [];
  const loads: string[] = [load()];
  try {
    // ---- 1. ratio
    const ratioSettings: Setting[] = ['lz4', 'crc', 'lz4+enc'];
    for (const s of ratioSettings) {
      const r = await randomRow(ctx, s, randomFile.path);
      ratio.push(r);
      log(`  ratio random ${s}: written ${formatSize(r.written)}, store ${formatSize(r.storeBefore)} (${fmt(r.storeBefore / r.written)}×)`);
    }
    if (WORKSPACES) {
      const fxDir = makeTempDir('baton-bench-frames-fx-', root);
      const seedSrc = path.join(fxDir, 'src');
      await makeSourceRepo(seedSrc, rngFrom(SEED));
      const seedNpm = await makeNpmProject(fxDir);
      const realApp = path.join(fxDir, 'real-app');
      fs.mkdirSync(realApp);
      fs.copyFileSync(path.join(REPO_ROOT, 'package.json'), path.join(realApp, 'package.json'));
      fs.copyFileSync(path.join(REPO_ROOT, 'package-lock.json'), path.join(realApp, 'package-lock.json'));
      const fx = { seed: { src: seedSrc, app: seedNpm.app, work: fxDir }, real: { src: REPO_ROOT, app: realApp, work: fxDir } };
      for (const kind of ['seed', 'real'] as const) {
        for (const s of ratioSettings) {
          const r = await buildWorkspace(ctx, kind, fx[kind], s);
          ratio.push(r);
          log(`  ratio ${kind} ${s}: built in ${fmt(r.buildS)} s; written ${formatSize(r.written)}, store ${formatSize(r.storeBefore)} (${fmt(r.storeBefore / r.written)}×), accounting ${formatSize(r.writtenStored)}`);
        }
      }
    }
    // GC until quiet (the ext4 journal and metadata overwrite themselves: garbage until collected).
    await ctx.server!.stop();
    ctx.server = null;
    await gcUntilQuiet(ctx.store, { env: { BATON_HOME: ctx.env.BATON_HOME as string } });
    const vols = JSON.parse(cli(ctx, ['ls', '--json'])) as VolJson[];
    for (const r of ratio) {
      const v = vols.filter((x) => x.name.startsWith(r.workload === 'random' ? 'rand-' : `ws-${r.workload}-`) && x.name.includes(`-${r.setting.replace('+', '-')}-`));
      r.storeAfterGc = v[0] ? v[0].storedBytes : NaN;
    }
    for (const v of vols) cli(ctx, ['rm', v.name]);
    await gcUntilQuiet(ctx.store, { env: { BATON_HOME: ctx.env.BATON_HOME as string } });
    await serve(ctx);
    loads.push(load());

    await throughput(ctx, 'file:', randomFile.path, textFile, copies, flushes, loads);
    await ctx.server!.stop();
    ctx.server = null;
    if (RGW) {
      const { rgw } = await startRgwBucket(path.join(root, 'rgw'), 'bench');
      try {
        const rctx: Ctx = { root: makeTempDir('baton-bench-frames-rgw-', root), store: 's3://bench/frames', env: { ...ctx.env, ...rgw.env }, server: null, n: 0 };
        await serve(rctx);
        try {
          await throughput(rctx, 'radosgw', randomFile.path, textFile, copies, flushes, loads);
        } finally {
          await rctx.server?.stop();
        }
      } finally {
        await rgw.stop();
      }
    }
  } finally {
    await ctx.server?.stop();
  }
  report(machine, ratio, copies, flushes, loads, randomFile.onTmpfs);
}

function report(machine: ReturnType<typeof machineInfo>, ratio: RatioRow[], copies: CopyRow[], flushes: FlushRow[], loads: string[], onTmpfs: boolean): void {
  const med = (xs: number[]): number => median(xs.filter(Number.isFinite));
  const stores = [...new Set(copies.map((c) => c.store))];
  const tpOf = (st: string, data: string, s: Setting, k: 'writeMiBs' | 'readMiBs'): number => med(copies.filter((c) => c.store === st && c.data === data && c.setting === s).map((c) => c[k]));
  const flOf = (st: string, s: Setting, k: 'p50' | 'p99'): number => med(flushes.filter((f) => f.store === st && f.setting === s).map((f) => f[k]));
  const goals: GoalRow[] = [];
  const rr = (w: string, s: Setting): RatioRow | undefined => ratio.find((r) => r.workload === w && r.setting === s);
  for (const w of ['seed', 'real', 'random']) {
    const r = rr(w, 'lz4');
    if (r) goals.push(limitGoal(`store ÷ logical bytes, ${w === 'random' ? 'random data' : `${w} workspace`} (lz4, after GC)`, r.storeAfterGc / r.written, '×', '≤', w === 'random' ? 1.01 : 0.5));
  }
  for (const st of stores) {
    const tp = (data: string, s: Setting, k: 'writeMiBs' | 'readMiBs'): number => tpOf(st, data, s, k);
    const fl = (s: Setting, k: 'p50' | 'p99'): number => flOf(st, s, k);
    for (const data of ['random', 'text']) {
      for (const k of ['writeMiBs', 'readMiBs'] as const) {
        goals.push(ratioGoal(`[${st}] sequential ${k === 'writeMiBs' ? 'write' : 'read'} (${data}), lz4 + checksums ÷ raw`, tp(data, 'lz4', k), 'raw', tp(data, 'raw', k), 'MiB/s', 0.9));
        goals.push(ratioGoal(`[${st}] sequential ${k === 'writeMiBs' ? 'write' : 'read'} (${data}), encrypted ÷ raw`, tp(data, 'lz4+enc', k), 'raw', tp(data, 'raw', k), 'MiB/s', 0.8));
      }
    }
    goals.push(limitGoal(`[${st}] FLUSH p50, lz4 + checksums − raw`, (fl('lz4', 'p50') - fl('raw', 'p50')) / 1000, 'ms', '≤', 1));
    goals.push(limitGoal(`[${st}] FLUSH p50, encrypted − raw`, (fl('lz4+enc', 'p50') - fl('raw', 'p50')) / 1000, 'ms', '≤', 1));
  }

  const L: string[] = [];
  L.push('# frames: compression, checksums, encryption (issue 16)', '');
  L.push(`${machine.date.slice(0, 16).replace('T', ' ')} UTC, ${machine.nproc} cores, baton ${machine.batonCommit ?? '?'}; load average ${loads.join(' → ')} (at start, after the ratio part, after each pass). Knobs: SIZE=${formatSize(SIZE)}, REPEAT=${REPEAT}, RUNTIME=${RUNTIME}, WORKSPACES=${WORKSPACES ? 1 : 0}, RGW=${RGW ? 1 : 0}. Produced by \`node dist/bench/frames.js\`. Every row is this build, one \`baton serve\` on a \`file:\` store; the settings differ only in \`baton create\` options: raw = \`--data-format raw\` (no frames, no checks: the layout before issue 16), crc = \`--compression none\`, lz4 = default, lz4+enc = \`--encrypt\`. Random input ${onTmpfs ? 'on tmpfs' : 'in the temp dir'}.`, '');
  L.push('## Goals', '', markdownTable(['goal', 'value', 'peer', 'result', 'target', ''], goals.map((g) => [g.goal, g.baton, g.peer, g.result, g.target, g.pass === null ? '?' : g.pass ? '✓' : '✗']), ['l', 'r', 'r', 'r', 'l', 'l']), '');
  L.push('## Store bytes ÷ logical bytes', '', 'logical = the volume\'s written bytes (`baton ls`: what its map names); store = every object under its prefix, right after the build and after `baton gc` until quiet; "accounting" = `ls`\'s written stored bytes.', '');
  L.push(markdownTable(['workload', 'setting', 'logical', 'store (before GC)', 'store (after GC)', 'ratio after GC', 'accounting', 'build s'],
    ratio.map((r) => [r.workload, r.setting, formatSize(r.written), formatSize(r.storeBefore), formatSize(r.storeAfterGc), fmt(r.storeAfterGc / r.written), formatSize(r.writtenStored), fmt(r.buildS)]), ['l', 'l', 'r', 'r', 'r', 'r', 'r', 'r']), '');
  for (const st of stores) {
    const tp = (data: string, s: Setting, k: 'writeMiBs' | 'readMiBs'): number => tpOf(st, data, s, k);
    const fl = (s: Setting, k: 'p50' | 'p99'): number => flOf(st, s, k);
    L.push(`## Sequential throughput on ${st} (nbdcopy, MiB/s, medians of passes)`, '');
    if (st === 'radosgw') L.push('The read follows the write on the same server: it is served from the read cache the write filled (stored bytes, decoded and checked on every read).', '');
    L.push(markdownTable(['data', 'setting', 'write', 'read', 'write ÷ raw', 'read ÷ raw', 'per pass (write / read)'],
      (['random', 'text'] as const).flatMap((d) => ALL.map((s) => [d, s, fmt(tp(d, s, 'writeMiBs')), fmt(tp(d, s, 'readMiBs')), fmt(tp(d, s, 'writeMiBs') / tp(d, 'raw', 'writeMiBs')), fmt(tp(d, s, 'readMiBs') / tp(d, 'raw', 'readMiBs')),
        copies.filter((c) => c.store === st && c.data === d && c.setting === s).map((c) => `${fmt(c.writeMiBs)}/${fmt(c.readMiBs)}`).join(', ')])), ['l', 'l', 'r', 'r', 'r', 'r', 'l']), '');
    L.push(`## FLUSH latency on ${st} (fio randwrite 4k QD1 fsync=1, µs, medians of passes)`, '');
    L.push(markdownTable(['setting', 'p50', 'p99', 'p50 − raw', 'per pass p50'],
      ALL.map((s) => [s, fmt(fl(s, 'p50')), fmt(fl(s, 'p99')), fmt(fl(s, 'p50') - fl('raw', 'p50')), flushes.filter((f) => f.store === st && f.setting === s).map((f) => fmt(f.p50)).join(', ')]), ['l', 'r', 'r', 'r', 'l']), '');
  }
  const out = writeResults('frames', L.join('\n'), { machine, loads, knobs: { SIZE, REPEAT, RUNTIME, WORKSPACES, RGW }, ratio, copies, flushes, goals });
  log(`frames: results in ${out.md}`);
  process.stdout.write(L.join('\n') + '\n');
}

main().catch((err: unknown) => { log(`frames bench failed: ${err instanceof Error ? err.stack : String(err)}`); process.exitCode = 1; });
