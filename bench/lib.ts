/**
 * Shared pieces of the macro-benchmark harness (`bench/*.ts`, compiled to dist/bench/).
 *
 * A scenario file starts servers with `startBaton` / `startNbdkit`, drives them with the
 * real clients (`runFio`, `runNbdcopy`), and renders what it measured with `markdownTable`
 * and `writeResults`. Everything a scenario spawns is tracked here: servers and clients
 * are killed and temp files removed when the scenario ends, fails, or is interrupted
 * (SIGINT/SIGTERM), and where util-linux `setpriv` exists every child also gets a
 * parent-death signal, so even a SIGKILLed harness leaves no server behind.
 *
 * Only Unix sockets in a private temp directory are used; nothing listens on TCP.
 *
 * The variables that matter for NBD numbers (nbdkit `BENCHMARKING`): the client (fio's nbd
 * engine is one connection per job; nbdcopy opens min(4, threads) connections and keeps 64
 * requests of 256 KiB in flight on each, see /work/shared/notes/nbd-protocol.md §2.4/§2.5),
 * multi-conn, block size, and the number of cores client and server share.
 */

import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { randomFillSync } from 'node:crypto';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseSize } from '../src/size.js';

export const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
export const BATON_BIN = path.join(REPO_ROOT, 'dist', 'cli', 'baton.js');
export const RESULTS_DIR = path.join(REPO_ROOT, 'bench', 'results');

export const MiB = 1024 * 1024;

// ------------------------------------------------------------------ environment knobs

export function envSize(name: string, dflt: string): number {
  return parseSize(process.env[name] || dflt);
}

export function envNumber(name: string, dflt: number): number {
  const v = process.env[name];
  if (v === undefined || v === '') return dflt;
  const n = Number(v);
  if (!Number.isFinite(n) || n < 0) throw new Error(`${name}=${v}: not a non-negative number`);
  return n;
}

export function envFlag(name: string, dflt: boolean): boolean {
  const v = process.env[name];
  if (v === undefined || v === '') return dflt;
  return !/^(0|false|no|off)$/i.test(v);
}

// ------------------------------------------------------------------ cleanup of everything we start

const liveChildren = new Set<ChildProcess>();
const tempPaths = new Set<string>();
let signalHandlersInstalled = false;

function installCleanupHandlers(): void {
  if (signalHandlersInstalled) return;
  signalHandlersInstalled = true;
  // Last resort: 'exit' handlers must be synchronous, so SIGKILL and rmSync.
  process.on('exit', () => cleanupSync());
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    process.on(sig, () => {
      process.stderr.write(`\nbench: ${sig}, killing servers and clients\n`);
      cleanupSync();
      process.exit(sig === 'SIGINT' ? 130 : 143);
    });
  }
}

function cleanupSync(): void {
  for (const c of liveChildren) {
    if (c.exitCode === null && c.signalCode === null) { try { c.kill('SIGKILL'); } catch { /* gone */ } }
  }
  liveChildren.clear();
  for (const p of tempPaths) { try { fs.rmSync(p, { recursive: true, force: true }); } catch { /* best effort */ } }
  tempPaths.clear();
}

/**
 * A temp directory `BASE/PREFIX<pid>-XXXXXX`, removed when the process exits (also on failure
 * or Ctrl-C). Directories with the same prefix left by a harness that was SIGKILLed (whose
 * pid is gone) are swept first: a 1 GiB source file in /dev/shm would otherwise hold RAM.
 */
export function makeTempDir(prefix: string, base = os.tmpdir()): string {
  installCleanupHandlers();
  sweepStale(base, prefix);
  const dir = fs.mkdtempSync(path.join(base, `${prefix}${process.pid}-`));
  tempPaths.add(dir);
  return dir;
}

function sweepStale(base: string, prefix: string): void {
  let names: string[];
  try { names = fs.readdirSync(base); } catch { return; }
  for (const n of names) {
    if (!n.startsWith(prefix)) continue;
    const m = /^(\d+)-[^-]+$/.exec(n.slice(prefix.length));
    if (!m || Number(m[1]) === process.pid || fs.existsSync(`/proc/${m[1]}`)) continue;
    try { fs.rmSync(path.join(base, n), { recursive: true, force: true }); } catch { /* not ours to remove */ }
  }
}

/** Remove a temp path now (instead of at exit). */
export function removeTemp(p: string): void {
  fs.rmSync(p, { recursive: true, force: true });
  tempPaths.delete(p);
}

// ------------------------------------------------------------------ processes

const HAS_SETPRIV = has('setpriv');

/** Is an external tool on PATH? */
export function has(tool: string): boolean {
  return spawnSync('sh', ['-c', `command -v ${tool}`], { stdio: 'ignore' }).status === 0;
}

/** First line of `tool --version` (or `-V`), or null if the tool is missing. */
export function toolVersion(tool: string, flag = '--version'): string | null {
  const r = spawnSync(tool, [flag], { encoding: 'utf8' });
  if (r.error || r.status !== 0) return null;
  return (r.stdout || r.stderr).trim().split('\n')[0] ?? null;
}

/**
 * Spawn a tracked child. With `setpriv --pdeathsig SIGKILL` the kernel kills it if this
 * process dies without running its cleanup; the child's pid is still the tool's own pid
 * (setpriv execs), so /proc/PID/stat measures the tool.
 */
export function spawnTracked(argv: string[], opts: { env?: NodeJS.ProcessEnv; stdout?: 'pipe' | 'ignore' } = {}): ChildProcess {
  installCleanupHandlers();
  const [cmd, ...args] = HAS_SETPRIV ? ['setpriv', '--pdeathsig', 'SIGKILL', '--', ...argv] : argv;
  const child = spawn(cmd!, args, { stdio: ['ignore', opts.stdout ?? 'pipe', 'pipe'], env: opts.env ?? process.env });
  liveChildren.add(child);
  child.once('exit', () => liveChildren.delete(child));
  return child;
}

export interface CommandResult {
  argv: string[];
  code: number;
  stdout: string;
  stderr: string;
  seconds: number;
}

export class CommandError extends Error {
  constructor(readonly result: CommandResult) {
    super(`command failed (exit ${result.code}): ${shellQuote(result.argv)}\n${tail(result.stderr || result.stdout, 2000)}`);
    this.name = 'CommandError';
  }
}

/** Run a command to completion; wall time measured around the process. Throws CommandError on non-zero exit. */
export async function runCommand(argv: string[], opts: { timeoutMs?: number; env?: NodeJS.ProcessEnv } = {}): Promise<CommandResult> {
  const child = spawnTracked(argv, opts.env ? { env: opts.env } : {});
  const t0 = process.hrtime.bigint();
  let stdout = '';
  let stderr = '';
  child.stdout!.on('data', (d: Buffer) => { stdout += d.toString(); });
  child.stderr!.on('data', (d: Buffer) => { stderr += d.toString(); });
  let timedOut = false;
  const timer = opts.timeoutMs ? setTimeout(() => { timedOut = true; child.kill('SIGKILL'); }, opts.timeoutMs) : null;
  const code = await new Promise<number>((resolve, reject) => {
    child.once('error', reject);
    child.once('close', (c, sig) => resolve(c ?? (sig ? 128 : 1)));
  });
  if (timer) clearTimeout(timer);
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  const result: CommandResult = { argv, code, stdout, stderr: timedOut ? `${stderr}\n(killed after ${opts.timeoutMs} ms timeout)` : stderr, seconds };
  if (code !== 0) throw new CommandError(result);
  return result;
}

export function shellQuote(argv: string[]): string {
  return argv.map((a) => (/^[\w@%+=:,./-]+$/.test(a) ? a : `'${a.replace(/'/g, `'\\''`)}'`)).join(' ');
}

function tail(s: string, n: number): string {
  return s.length > n ? '…' + s.slice(-n) : s;
}

const CLK_TCK = Number(spawnSync('getconf', ['CLK_TCK'], { encoding: 'utf8' }).stdout?.trim()) || 100;

/** user+system CPU seconds a process (all its threads) has used so far, from /proc/PID/stat; NaN if unknown. */
export function processCpuSeconds(pid: number | undefined): number {
  if (pid === undefined) return NaN;
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    // Fields after the parenthesised command name (which may contain spaces); utime, stime are fields 14, 15.
    const rest = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return (Number(rest[11]) + Number(rest[12])) / CLK_TCK;
  } catch {
    return NaN;
  }
}

// ------------------------------------------------------------------ servers

export interface Server {
  /** Short name for tables: "baton", "nbdkit". */
  readonly kind: string;
  /** libnbd URI of the export. */
  readonly uri: string;
  readonly socket: string;
  readonly pid: number | undefined;
  /** The command that started it (as a user would type it). */
  readonly argv: string[];
  alive(): boolean;
  /** "running", or how it ended ("exit 1", "signal SIGKILL"). */
  status(): string;
  /** CPU seconds the server process has used so far. */
  cpuSeconds(): number;
  /** Collected stderr (last 64 KiB). */
  stderr(): string;
  /** SIGTERM, wait (graceful: baton flushes and a --cpu-prof profile is written), SIGKILL after graceMs. */
  stop(graceMs?: number): Promise<void>;
}

export async function waitForSocket(socket: string, child: ChildProcess, timeoutMs = 15_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (child.exitCode !== null || child.signalCode !== null) throw new Error(`server exited before listening on ${socket}`);
    const ok = await new Promise<boolean>((resolve) => {
      const s = net.connect(socket);
      s.once('connect', () => { s.destroy(); resolve(true); });
      s.once('error', () => resolve(false));
    });
    if (ok) return;
    if (Date.now() > deadline) throw new Error(`server socket ${socket} did not come up in ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

async function startServer(kind: string, argv: string[], socket: string, uri: string, env?: NodeJS.ProcessEnv): Promise<Server> {
  const child = spawnTracked(argv, { ...(env ? { env } : {}), stdout: 'ignore' });
  let err = '';
  child.stderr!.on('data', (d: Buffer) => { err = (err + d.toString()).slice(-65536); });
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  const alive = (): boolean => child.exitCode === null && child.signalCode === null;
  const server: Server = {
    kind,
    uri,
    socket,
    pid: child.pid,
    argv,
    alive,
    status: () => (alive() ? 'running' : child.signalCode ? `signal ${child.signalCode}` : `exit ${child.exitCode}`),
    cpuSeconds: () => processCpuSeconds(child.pid),
    stderr: () => err,
    stop: async (graceMs = 10_000) => {
      if (!alive()) return;
      child.kill('SIGTERM');
      const timer = setTimeout(() => { if (alive()) child.kill('SIGKILL'); }, graceMs);
      await exited;
      clearTimeout(timer);
    },
  };
  try {
    await waitForSocket(socket, child);
  } catch (e) {
    child.kill('SIGKILL');
    await exited;
    throw new Error(`${kind} did not start: ${(e as Error).message}\n${tail(err, 2000)}`);
  }
  return server;
}

export interface BatonOptions {
  /** Directory for the socket (a makeTempDir). */
  dir: string;
  /** Volume (export) created at start with `--create NAME --size SIZE`. */
  volume: string;
  size: number;
  /** `--store` URL; default `memory:`. */
  store?: string;
  /** Arguments for node itself, e.g. `--cpu-prof`. */
  nodeArgs?: string[];
  /** More `baton serve` arguments. */
  extraArgs?: string[];
  logLevel?: string;
  env?: NodeJS.ProcessEnv;
}

/**
 * `node dist/cli/baton.js serve --socket DIR/baton.sock --store STORE --create NAME --size SIZE`.
 * Everything baton keeps on disk stays in DIR: BATON_HOME=DIR/home, BATON_CACHE_DIR=DIR/cache,
 * and a store URL without a path (`file:`, `raw:`) becomes DIR/store.
 */
export async function startBaton(o: BatonOptions): Promise<Server> {
  if (!fs.existsSync(BATON_BIN)) throw new Error(`${BATON_BIN} is missing: build first (npx tsc -p .)`);
  const socket = path.join(o.dir, 'baton.sock');
  let store = o.store ?? 'memory:';
  if (store === 'file:' || store === 'raw:') store += path.join(o.dir, 'store');
  const argv = [
    process.execPath, ...(o.nodeArgs ?? []), BATON_BIN, 'serve', '--socket', socket, '--store', store,
    '--create', o.volume, '--size', String(o.size), '--log-level', o.logLevel ?? 'warn', ...(o.extraArgs ?? []),
  ];
  const env = { ...process.env, BATON_HOME: path.join(o.dir, 'home'), BATON_CACHE_DIR: path.join(o.dir, 'cache'), ...o.env };
  return startServer('baton', argv, socket, `nbd+unix:///${o.volume}?socket=${socket}`, env);
}

export interface NbdkitOptions {
  dir: string;
  /** Plugin and its arguments, e.g. `['memory', '1073741824']`. */
  plugin: string[];
  /** `--filter=NAME` for each. */
  filters?: string[];
  extraArgs?: string[];
}

/**
 * `nbdkit -f --exit-with-parent -U DIR/nbdkit.sock [--filter=…] PLUGIN ARGS`. `-f` keeps it in the
 * foreground so the pid we hold is the server (otherwise it forks away and we could not stop it).
 */
export async function startNbdkit(o: NbdkitOptions): Promise<Server> {
  const socket = path.join(o.dir, 'nbdkit.sock');
  const argv = ['nbdkit', '-f', '--exit-with-parent', '-U', socket, ...(o.filters ?? []).map((f) => `--filter=${f}`), ...(o.extraArgs ?? []), ...o.plugin];
  return startServer('nbdkit', argv, socket, `nbd+unix:///?socket=${socket}`);
}

// ------------------------------------------------------------------ clients

export interface NbdcopyResult {
  argv: string[];
  seconds: number;
  bytes: number;
  /** bytes / seconds, in MiB/s. */
  mibPerSec: number;
}

/** `nbdcopy [--flush] [extra] SRC DST`, timed around the process (connect + copy + flush). */
export async function runNbdcopy(src: string, dst: string, bytes: number, o: { flush?: boolean; extra?: string[]; timeoutMs?: number } = {}): Promise<NbdcopyResult> {
  const argv = ['nbdcopy', ...(o.flush ? ['--flush'] : []), ...(o.extra ?? []), src, dst];
  const r = await runCommand(argv, { timeoutMs: o.timeoutMs ?? 600_000 });
  return { argv, seconds: r.seconds, bytes, mibPerSec: bytes / MiB / r.seconds };
}

export interface FioJob {
  name: string;
  rw: 'read' | 'write' | 'randread' | 'randwrite';
  bs: string;
  iodepth: number;
  /** Seconds (`--time_based --runtime`). */
  runtime: number;
  /** Bytes of the target to spread I/O over. */
  size: number;
  ioengine: 'nbd' | 'libaio' | 'io_uring' | 'psync';
  /** For ioengine=nbd. */
  uri?: string;
  /** For file engines. */
  filename?: string;
  direct?: boolean;
  /** `--fsync=N`: a flush after every N writes. */
  fsync?: number;
  extra?: string[];
}

export interface Percentiles { p50: number; p99: number; mean: number }

export interface FioResult {
  argv: string[];
  iops: number;
  mibPerSec: number;
  /** Total latency (submission + completion) of the data direction, µs. */
  latUs: Percentiles;
  /** Latency of the flushes (`--fsync`), µs; null without fsync. */
  syncUs: Percentiles | null;
  /** The job object from fio's JSON output. */
  raw: Record<string, unknown>;
}

export function fioArgv(job: FioJob, outputFile: string): string[] {
  return [
    'fio', `--name=${job.name}`, `--ioengine=${job.ioengine}`,
    ...(job.uri ? [`--uri=${job.uri}`] : []),
    ...(job.filename ? [`--filename=${job.filename}`] : []),
    `--rw=${job.rw}`, `--bs=${job.bs}`, `--iodepth=${job.iodepth}`, `--direct=${job.direct === false ? 0 : 1}`,
    ...(job.fsync ? [`--fsync=${job.fsync}`] : []),
    '--time_based', `--runtime=${job.runtime}`, `--size=${job.size}`,
    // Percentiles of total latency (slat + clat), not only clat: for the async nbd engine
    // submission is part of what a caller waits for.
    '--lat_percentiles=1',
    ...(job.extra ?? []),
    '--output-format=json', `--output=${outputFile}`,
  ];
}

function pct(p: unknown): Percentiles {
  const o = (p ?? {}) as { mean?: number; percentile?: Record<string, number> };
  const q = o.percentile ?? {};
  return { p50: (q['50.000000'] ?? NaN) / 1000, p99: (q['99.000000'] ?? NaN) / 1000, mean: (o.mean ?? NaN) / 1000 };
}

/** Parse fio's `--output-format=json` text (tolerates lines before the JSON, e.g. the nbd engine's "connected"). */
export function parseFioJson(text: string, rw: FioJob['rw']): Omit<FioResult, 'argv'> {
  const start = text.indexOf('{');
  if (start < 0) throw new Error(`no JSON in fio output: ${tail(text, 500)}`);
  const doc = JSON.parse(text.slice(start)) as { jobs?: Record<string, unknown>[] };
  const job = doc.jobs?.[0];
  if (!job) throw new Error('fio JSON has no jobs');
  if (job.error) throw new Error(`fio job ${String(job.jobname)} failed: error ${String(job.error)}`);
  const dir = (rw.includes('read') ? job.read : job.write) as { iops: number; bw_bytes: number; lat_ns?: unknown; clat_ns?: unknown };
  const latSrc = (dir.lat_ns as { percentile?: unknown } | undefined)?.percentile ? dir.lat_ns : dir.clat_ns;
  const sync = job.sync as { total_ios?: number; lat_ns?: unknown } | undefined;
  return {
    iops: dir.iops,
    mibPerSec: dir.bw_bytes / MiB,
    latUs: pct(latSrc),
    syncUs: sync && sync.total_ios ? pct(sync.lat_ns) : null,
    raw: job,
  };
}

export async function runFio(job: FioJob, outDir: string): Promise<FioResult> {
  const out = path.join(outDir, `fio-${job.name}-${process.hrtime.bigint()}.json`);
  const argv = fioArgv(job, out);
  await runCommand(argv, { timeoutMs: (job.runtime + 120) * 1000 });
  const parsed = parseFioJson(fs.readFileSync(out, 'utf8'), job.rw);
  fs.rmSync(out, { force: true });
  return { argv, ...parsed };
}

// ------------------------------------------------------------------ input data

/**
 * A file of `size` random bytes (incompressible, no zero blocks for nbdcopy to skip), on
 * tmpfs (/dev/shm) when it has room so reading the source costs no disk I/O, else in the
 * temp dir. Removed at exit.
 */
export function makeRandomFile(size: number, prefix = 'baton-bench-'): { path: string; onTmpfs: boolean; seconds: number } {
  let base = os.tmpdir();
  let onTmpfs = false;
  try {
    const st = fs.statfsSync('/dev/shm');
    if (st.bavail * st.bsize > size + 256 * MiB) { base = '/dev/shm'; onTmpfs = true; }
  } catch { /* no /dev/shm */ }
  const dir = makeTempDir(prefix, base);
  const file = path.join(dir, 'random.bin');
  const t0 = process.hrtime.bigint();
  const fd = fs.openSync(file, 'w');
  try {
    const chunk = Buffer.allocUnsafe(16 * MiB);
    for (let done = 0; done < size;) {
      const n = Math.min(chunk.length, size - done);
      randomFillSync(chunk, 0, n);
      fs.writeSync(fd, chunk, 0, n);
      done += n;
    }
  } finally {
    fs.closeSync(fd);
  }
  return { path: file, onTmpfs, seconds: Number(process.hrtime.bigint() - t0) / 1e9 };
}

// ------------------------------------------------------------------ machine

export interface MachineInfo {
  date: string;
  hostname: string;
  nproc: number;
  cpuModel: string;
  memTotalGiB: number;
  kernel: string;
  loadavgAtStart: number[];
  node: string;
  nbdkit: string | null;
  nbdcopy: string | null;
  fio: string | null;
  batonCommit: string | null;
  tmpdir: string;
  tmpdirFs: string | null;
}

export function machineInfo(): MachineInfo {
  const git = spawnSync('git', ['-C', REPO_ROOT, 'rev-parse', '--short', 'HEAD'], { encoding: 'utf8' });
  const df = spawnSync('df', ['--output=source,fstype', os.tmpdir()], { encoding: 'utf8' });
  return {
    date: new Date().toISOString(),
    hostname: os.hostname(),
    nproc: os.availableParallelism(),
    cpuModel: os.cpus()[0]?.model ?? 'unknown',
    memTotalGiB: Math.round((os.totalmem() / 1024 ** 3) * 10) / 10,
    kernel: `${os.type()} ${os.release()}`,
    loadavgAtStart: os.loadavg().map((x) => Math.round(x * 100) / 100),
    node: process.version,
    nbdkit: toolVersion('nbdkit'),
    nbdcopy: toolVersion('nbdcopy'),
    fio: toolVersion('fio'),
    batonCommit: git.status === 0 ? git.stdout.trim() : null,
    tmpdir: os.tmpdir(),
    tmpdirFs: df.status === 0 ? (df.stdout.trim().split('\n')[1]?.trim().replace(/\s+/g, ' ') ?? null) : null,
  };
}

// ------------------------------------------------------------------ numbers and tables

export function median(xs: number[]): number {
  const v = xs.filter((x) => Number.isFinite(x)).sort((a, b) => a - b);
  if (v.length === 0) return NaN;
  const m = Math.floor(v.length / 2);
  return v.length % 2 ? v[m]! : (v[m - 1]! + v[m]!) / 2;
}

/** A number for a table: 3 significant digits, thousands kept whole; "–" for missing. */
export function fmt(n: number | null | undefined): string {
  if (n === null || n === undefined || !Number.isFinite(n)) return '–';
  const a = Math.abs(n);
  if (a >= 1000) return Math.round(n).toLocaleString('en-US');
  if (a >= 100) return n.toFixed(0);
  if (a >= 10) return n.toFixed(1);
  return n.toFixed(2);
}

export function ratio(a: number | null | undefined, b: number | null | undefined): number {
  if (a === null || a === undefined || b === null || b === undefined || !Number.isFinite(a) || !Number.isFinite(b) || b === 0) return NaN;
  return a / b;
}

export function fmtRatio(r: number): string {
  return Number.isFinite(r) ? `${r.toFixed(2)}×` : '–';
}

/** A GitHub-flavoured markdown table; `align` per column, 'r' right-aligns. */
export function markdownTable(headers: string[], rows: string[][], align: ('l' | 'r')[] = []): string {
  const esc = (s: string): string => s.replace(/\|/g, '\\|');
  const sep = headers.map((_, i) => (align[i] === 'r' ? '---:' : '---'));
  return [headers, sep, ...rows].map((r, i) => `| ${(i === 1 ? r : r.map(esc)).join(' | ')} |`).join('\n') + '\n';
}

/** Write RESULTS_DIR/NAME.md and RESULTS_DIR/NAME.json; returns their paths. */
export function writeResults(name: string, markdown: string, json: unknown): { md: string; json: string } {
  fs.mkdirSync(RESULTS_DIR, { recursive: true });
  const md = path.join(RESULTS_DIR, `${name}.md`);
  const js = path.join(RESULTS_DIR, `${name}.json`);
  fs.writeFileSync(md, markdown);
  fs.writeFileSync(js, JSON.stringify(json, null, 2) + '\n');
  return { md, json: js };
}

// ------------------------------------------------------------------ CPU profiles (node --cpu-prof)

export interface ProfileEntry { fn: string; where: string; selfMs: number; selfPct: number }

/** Top functions by self time in a V8 `.cpuprofile` (from `node --cpu-prof`). */
export function summarizeCpuProfile(file: string, top = 15): ProfileEntry[] {
  const prof = JSON.parse(fs.readFileSync(file, 'utf8')) as {
    nodes: { id: number; callFrame: { functionName: string; url: string; lineNumber: number }; hitCount?: number }[];
    startTime: number; endTime: number; samples: number[];
  };
  const totalMs = (prof.endTime - prof.startTime) / 1000;
  const totalHits = prof.samples.length || 1;
  const byFn = new Map<string, ProfileEntry>();
  for (const n of prof.nodes) {
    const hits = n.hitCount ?? 0;
    if (!hits) continue;
    const cf = n.callFrame;
    const fn = cf.functionName || '(anonymous)';
    const where = cf.url ? `${cf.url.replace(/^file:\/\//, '').replace(REPO_ROOT + '/', '')}:${cf.lineNumber + 1}` : '';
    const key = `${fn} ${where}`;
    const e = byFn.get(key) ?? { fn, where, selfMs: 0, selfPct: 0 };
    e.selfMs += (hits / totalHits) * totalMs;
    e.selfPct += (hits / totalHits) * 100;
    byFn.set(key, e);
  }
  return [...byFn.values()].sort((a, b) => b.selfMs - a.selfMs).slice(0, top);
}
