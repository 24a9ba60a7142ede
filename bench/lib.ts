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
import * as http from 'node:http';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseSize } from '../src/size.js';

export const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
export const BATON_BIN = path.join(REPO_ROOT, 'dist', 'cli', 'bin.cjs');
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

/**
 * Synchronous last-resort undo steps for things that are not processes (mounts, loop devices,
 * a radosgw cluster). 'before' hooks run before the tracked children are killed (unmount while
 * the NBD server still answers), 'after' hooks after it (stop radosgw once nothing talks to
 * it). Scenarios undo in `finally` blocks themselves; these only run for what is left at exit.
 */
const exitHooks: { phase: 'before' | 'after'; fn: () => void }[] = [];

/** Register a synchronous undo step for exit; returns a function that unregisters it. */
export function onExitCleanup(fn: () => void, phase: 'before' | 'after' = 'before'): () => void {
  installCleanupHandlers();
  const h = { phase, fn };
  exitHooks.push(h);
  return () => { const i = exitHooks.indexOf(h); if (i >= 0) exitHooks.splice(i, 1); };
}

function runExitHooks(phase: 'before' | 'after'): void {
  // Newest first: a mount registered after its loop device is undone before it.
  for (const h of [...exitHooks].reverse()) {
    if (h.phase !== phase) continue;
    exitHooks.splice(exitHooks.indexOf(h), 1);
    try { h.fn(); } catch { /* best effort */ }
  }
}

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
  runExitHooks('before');
  for (const c of liveChildren) {
    if (c.exitCode === null && c.signalCode === null) { try { c.kill('SIGKILL'); } catch { /* gone */ } }
  }
  liveChildren.clear();
  runExitHooks('after');
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
export function spawnTracked(argv: string[], opts: { env?: NodeJS.ProcessEnv; stdout?: 'pipe' | 'ignore'; cwd?: string; detached?: boolean } = {}): ChildProcess {
  installCleanupHandlers();
  const [cmd, ...args] = HAS_SETPRIV ? ['setpriv', '--pdeathsig', 'SIGKILL', '--', ...argv] : argv;
  // detached: own session (setsid), so a Ctrl-C to the harness's process group does not reach
  // it before the harness has undone what depends on it (nbdfuse under a mounted filesystem).
  const child = spawn(cmd!, args, {
    stdio: ['ignore', opts.stdout ?? 'pipe', 'pipe'], env: opts.env ?? process.env,
    ...(opts.cwd ? { cwd: opts.cwd } : {}), ...(opts.detached ? { detached: true } : {}),
  });
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
export async function runCommand(argv: string[], opts: { timeoutMs?: number; env?: NodeJS.ProcessEnv; cwd?: string } = {}): Promise<CommandResult> {
  const child = spawnTracked(argv, { ...(opts.env ? { env: opts.env } : {}), ...(opts.cwd ? { cwd: opts.cwd } : {}) });
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
  /** performance.now() just before the process was spawned. */
  readonly spawnedAt: number;
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

async function startServer(kind: string, argv: string[], socket: string, uri: string, env?: NodeJS.ProcessEnv, logFile?: string): Promise<Server> {
  const spawnedAt = performance.now();
  const child = spawnTracked(argv, { ...(env ? { env } : {}), stdout: 'ignore' });
  let err = '';
  // With logFile, all of stderr (baton logs there) is also kept in that file, not only the last 64 KiB.
  const logFd = logFile ? fs.openSync(logFile, 'a') : null;
  child.stderr!.on('data', (d: Buffer) => {
    err = (err + d.toString()).slice(-65536);
    if (logFd !== null) fs.writeSync(logFd, d);
  });
  if (logFd !== null) child.once('close', () => fs.closeSync(logFd));
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  const alive = (): boolean => child.exitCode === null && child.signalCode === null;
  const server: Server = {
    kind,
    uri,
    socket,
    pid: child.pid,
    argv,
    spawnedAt,
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
  /** false: serve an existing volume (no `--create`/`--size`, so no create request at start). Default true. */
  create?: boolean;
  /** Also write all of baton's stderr (its log) to this file. */
  logFile?: string;
}

/**
 * `node dist/cli/bin.cjs serve --socket DIR/baton.sock --store STORE --create NAME --size SIZE`.
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
    ...(o.create === false ? [] : ['--create', o.volume, '--size', String(o.size)]), '--log-level', o.logLevel ?? 'warn', ...(o.extraArgs ?? []),
  ];
  const env = { ...process.env, BATON_HOME: path.join(o.dir, 'home'), BATON_CACHE_DIR: path.join(o.dir, 'cache'), ...o.env };
  return startServer('baton', argv, socket, `nbd+unix:///${o.volume}?socket=${socket}`, env, o.logFile);
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

/**
 * Leave `bytes` of memory freed just now, so that the step after this finds the same memory
 * whichever server runs it: a file of that size written in 256 KiB writes, then deleted.
 * Why: on a microVM that gives free memory back to its host (virtio-balloon free page
 * reporting, this machine), the first touch of a page given back faults at the host, and a
 * page freed seconds ago is not given back yet. Without this, a 1 GiB write into a server's
 * page cache cost 0.5 s of system time or 4.7 s (the same `nbdkit file`, one after the other)
 * depending on what the steps before it had freed; the ratios measured the order of the
 * passes. Returns the seconds it took (a few when the memory was given back, under one else).
 */
export function freeMemoryBefore(dir: string, bytes: number): number {
  const t0 = process.hrtime.bigint();
  const file = path.join(dir, `warm-${process.pid}.bin`);
  const fd = fs.openSync(file, 'w');
  try {
    const chunk = Buffer.alloc(256 * 1024);
    for (let done = 0; done < bytes; done += chunk.length) fs.writeSync(fd, chunk, 0, chunk.length, done);
  } finally {
    fs.closeSync(fd);
    fs.rmSync(file, { force: true });
  }
  return Number(process.hrtime.bigint() - t0) / 1e9;
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

/** The q-quantile (0-1, nearest rank) of the finite values; NaN if none. */
export function quantile(xs: number[], q: number): number {
  const v = xs.filter((x) => Number.isFinite(x)).sort((a, b) => a - b);
  if (v.length === 0) return NaN;
  return v[Math.min(v.length - 1, Math.max(0, Math.ceil(q * v.length) - 1))]!;
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

// ------------------------------------------------------------------ radosgw (scripts/rgw.sh)

/** Request counters of radosgw (`perf dump`, section "rgw"): object GETs/PUTs and their bytes, all requests. */
export interface RgwCounters { req: number; failedReq: number; get: number; getBytes: number; put: number; putBytes: number }

export function diffCounters(after: RgwCounters, before: RgwCounters): RgwCounters {
  return {
    req: after.req - before.req, failedReq: after.failedReq - before.failedReq, get: after.get - before.get,
    getBytes: after.getBytes - before.getBytes, put: after.put - before.put, putBytes: after.putBytes - before.putBytes,
  };
}

/** One request from radosgw's access log (the beast frontend's line, logged at debug_rgw 1, the default). */
export interface RgwRequest {
  method: string;
  /** Path without the query string, URL-decoded: /BUCKET/KEY, or /BUCKET/ for a LIST. */
  path: string;
  query: string;
  status: number;
  /** The byte count radosgw logs: the object body for GET and PUT. */
  bytes: number;
  /** Server-side latency, ms (radosgw's clock: a few ms of granularity). */
  latencyMs: number;
}

const BEAST_LINE = /beast: \S+ \S+ - \S+ \[[^\]]*\] "(\w+) ([^ ?"]*)(\?[^ "]*)? HTTP\/[\d.]+" (\d+) (\d+|-) .* latency=([\d.]+)s/;

export function parseBeastLine(line: string): RgwRequest | null {
  const m = BEAST_LINE.exec(line);
  if (!m) return null;
  let p = m[2]!;
  try { p = decodeURIComponent(p); } catch { /* keep raw */ }
  return { method: m[1]!, path: p, query: m[3] ?? '', status: Number(m[4]), bytes: m[5] === '-' ? 0 : Number(m[5]), latencyMs: Number(m[6]) * 1000 };
}

export interface RgwServer {
  dir: string;
  endpoint: string;
  /** BATON_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION: for `baton serve`'s environment. */
  env: Record<string, string>;
  startSeconds: number;
  /** Counters from the admin socket (no python `ceph` CLI: ~1 ms instead of ~0.5 s). */
  counters(): Promise<RgwCounters>;
  /** Where the access log is now; pass it to `requestsSince`. */
  logMark(): number;
  /**
   * The requests logged since `mark`. The log is written asynchronously: waits (up to timeoutMs)
   * until at least `expect` requests are there (e.g. the `req` delta of the counters).
   */
  requestsSince(mark: number, expect?: number, timeoutMs?: number): Promise<RgwRequest[]>;
  /** CPU seconds the cluster's daemons (mon, OSD, radosgw) have used so far. */
  cpuSeconds(): number;
  /** `rgw.sh stop DIR` (SIGKILLs the daemons, removes DIR). */
  stop(): Promise<void>;
}

/** CPU seconds of this process's children that ended and were waited for (nbdcopy, fio...), from /proc/self/stat. */
export function childrenCpuSeconds(): number {
  try {
    const stat = fs.readFileSync('/proc/self/stat', 'utf8');
    const rest = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return (Number(rest[13]) + Number(rest[14])) / CLK_TCK; // cutime, cstime: fields 16, 17
  } catch {
    return NaN;
  }
}

/** CPU seconds of this process so far. */
export function selfCpuSeconds(): number {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1e6;
}

/** Ask a Ceph daemon's admin socket: JSON command + NUL, reply is a u32 BE length and JSON. */
export function cephAdminSocket(sock: string, command: Record<string, unknown>, timeoutMs = 10_000): Promise<unknown> {
  return new Promise((resolve, reject) => {
    const s = net.connect(sock);
    let buf = Buffer.alloc(0);
    const timer = setTimeout(() => { s.destroy(); reject(new Error(`admin socket ${sock}: no answer in ${timeoutMs} ms`)); }, timeoutMs);
    s.once('connect', () => s.write(JSON.stringify(command) + '\0'));
    s.on('data', (d: Buffer) => {
      buf = Buffer.concat([buf, d]);
      if (buf.length >= 4 && buf.length >= 4 + buf.readUInt32BE(0)) {
        clearTimeout(timer);
        s.destroy();
        try { resolve(JSON.parse(buf.subarray(4, 4 + buf.readUInt32BE(0)).toString('utf8'))); } catch (e) { reject(e); }
      }
    });
    s.once('error', (e) => { clearTimeout(timer); reject(e); });
  });
}

/**
 * startRgw plus what every bench then does: make `bucket`, and describe the server for the
 * result header. The AWS SDK is imported here, not at the top, so benches without radosgw do
 * not pay for loading it.
 */
export async function startRgwBucket(dir: string, bucket: string): Promise<{ rgw: RgwServer; version: string; credentials: { accessKeyId: string; secretAccessKey: string } }> {
  const rgw = await startRgw(dir);
  let version = (await runCommand(['radosgw', '--version']).catch(() => null))?.stdout.trim().split('\n')[0]?.replace(/\s*\([0-9a-f]{40}\)/, '') ?? 'radosgw';
  version += ` (scripts/rgw.sh, one memstore OSD, loopback; started in ${rgw.startSeconds.toFixed(1)} s)`;
  const credentials = { accessKeyId: rgw.env.AWS_ACCESS_KEY_ID!, secretAccessKey: rgw.env.AWS_SECRET_ACCESS_KEY! };
  const { CreateBucketCommand, S3Client } = await import('@aws-sdk/client-s3');
  const s3 = new S3Client({ endpoint: rgw.endpoint, region: rgw.env.AWS_REGION ?? 'us-east-1', forcePathStyle: true, credentials });
  try {
    await s3.send(new CreateBucketCommand({ Bucket: bucket }));
  } catch (e) {
    await rgw.stop();
    throw e;
  } finally {
    s3.destroy();
  }
  return { rgw, version, credentials };
}

/**
 * A throwaway Ceph radosgw on loopback (`scripts/rgw.sh start DIR`; one memstore OSD, so what
 * is stored lives in RAM). Stopped by `stop()`, at exit, and by rgw.sh's own watchdog if this
 * process is SIGKILLed (RGW_WATCH_PID).
 */
export async function startRgw(dir: string): Promise<RgwServer> {
  const script = path.join(REPO_ROOT, 'scripts', 'rgw.sh');
  const stopSync = (): void => { spawnSync('bash', [script, 'stop', dir], { stdio: 'ignore', timeout: 20_000 }); };
  const unregister = onExitCleanup(stopSync, 'after');
  const r = await runCommand(['bash', script, 'start', dir], { timeoutMs: 120_000, env: { ...process.env, RGW_WATCH_PID: String(process.pid) } });
  const env: Record<string, string> = {};
  for (const line of fs.readFileSync(path.join(dir, 'env'), 'utf8').split('\n')) {
    const m = /^([A-Z0-9_]+)=(.*)$/.exec(line.trim());
    if (m) env[m[1]!] = m[2]!;
  }
  if (!env.BATON_S3_ENDPOINT || !env.AWS_ACCESS_KEY_ID || !env.AWS_SECRET_ACCESS_KEY) throw new Error(`rgw.sh wrote an incomplete ${dir}/env`);
  const asok = path.join(dir, 'run', 'client.rgw.a.asok');
  const logPath = path.join(dir, 'log', 'client.rgw.a.log');
  const readFrom = (mark: number): string => {
    const fd = fs.openSync(logPath, 'r');
    try {
      const size = fs.fstatSync(fd).size;
      if (size <= mark) return '';
      const b = Buffer.allocUnsafe(size - mark);
      let done = 0;
      while (done < b.length) { const n = fs.readSync(fd, b, done, b.length - done, mark + done); if (n === 0) break; done += n; }
      return b.subarray(0, done).toString('utf8');
    } finally {
      fs.closeSync(fd);
    }
  };
  return {
    dir,
    endpoint: env.BATON_S3_ENDPOINT,
    env,
    startSeconds: r.seconds,
    counters: async () => {
      const d = (await cephAdminSocket(asok, { prefix: 'perf dump' })) as { rgw?: Record<string, number> };
      const g = d.rgw ?? {};
      return { req: g.req ?? NaN, failedReq: g.failed_req ?? NaN, get: g.get ?? NaN, getBytes: g.get_b ?? NaN, put: g.put ?? NaN, putBytes: g.put_b ?? NaN };
    },
    cpuSeconds: () => {
      let sum = 0;
      try {
        for (const line of fs.readFileSync(path.join(dir, 'pids'), 'utf8').split('\n')) {
          const [name, pid] = line.trim().split(/\s+/);
          if (name && pid && name !== 'watchdog') sum += processCpuSeconds(Number(pid)) || 0;
        }
      } catch { return NaN; }
      return sum;
    },
    logMark: () => { try { return fs.statSync(logPath).size; } catch { return 0; } },
    requestsSince: async (mark, expect = 0, timeoutMs = 10_000) => {
      const deadline = Date.now() + timeoutMs;
      for (;;) {
        // Only whole lines: the writer may be in the middle of one.
        const text = readFrom(mark);
        const complete = text.slice(0, text.lastIndexOf('\n') + 1);
        const reqs = complete.split('\n').map(parseBeastLine).filter((x): x is RgwRequest => x !== null);
        if (reqs.length >= expect || Date.now() > deadline) return reqs;
        await new Promise((res) => setTimeout(res, 100));
      }
    },
    stop: async () => {
      unregister();
      await runCommand(['bash', script, 'stop', dir], { timeoutMs: 30_000 }).catch(() => {});
    },
  };
}

// ------------------------------------------------------------------ ext4 on any NBD export (nbdfuse + loop)

export interface Ext4Stack {
  /** Mount point. */
  mnt: string;
  /** The loop device. */
  dev: string;
  /** Seconds of each setup step: nbdfuse (until DIR/nbd exists), losetup, mkfs (if asked), mount. */
  seconds: { nbdfuse: number; losetup: number; mkfs?: number; mount: number };
  /** umount, losetup -d, fusermount3 -u (nbdfuse flushes and disconnects). Idempotent; throws if umount failed. */
  teardown(): Promise<void>;
}

function isMountpoint(dir: string): boolean {
  const want = path.resolve(dir);
  try {
    return fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n').some((l) => l.split(' ')[4] === want);
  } catch {
    return false;
  }
}

/**
 * A real kernel ext4 on an NBD export without the nbd kernel module (test/helpers/ext4.ts does
 * the same for tests): `nbdfuse FUSEDIR URI` exposes the export as FUSEDIR/nbd, `losetup -f
 * --show FUSEDIR/nbd` makes it a block device, then `mkfs.ext4 -q -F` (with `mkfs`) and `mount`.
 * Needs root. Every step is undone by `teardown()`, and at exit if the scenario did not get there.
 */
export async function attachExt4(uri: string, dir: string, o: { mkfs?: boolean; mkfsArgs?: string[]; mountOptions?: string } = {}): Promise<Ext4Stack> {
  const fuseDir = path.join(dir, 'fuse');
  const mnt = path.join(dir, 'mnt');
  fs.mkdirSync(fuseDir, { recursive: true });
  fs.mkdirSync(mnt, { recursive: true });
  const file = path.join(fuseDir, 'nbd');
  const seconds: Ext4Stack['seconds'] = { nbdfuse: NaN, losetup: NaN, mount: NaN };
  const since = (t: number): number => (performance.now() - t) / 1000;

  let t = performance.now();
  const fuse = spawnTracked(['nbdfuse', fuseDir, uri], { detached: true, stdout: 'ignore' });
  let fuseErr = '';
  fuse.stderr!.on('data', (d: Buffer) => { fuseErr = (fuseErr + d.toString()).slice(-8192); });
  const fuseExited = new Promise<void>((res) => fuse.once('exit', () => res()));
  const fuseAlive = (): boolean => fuse.exitCode === null && fuse.signalCode === null;
  let dev = '';
  const undoSync = (): void => {
    if (isMountpoint(mnt)) spawnSync('umount', ['-l', mnt], { stdio: 'ignore', timeout: 20_000 });
    if (dev) spawnSync('losetup', ['-d', dev], { stdio: 'ignore', timeout: 20_000 });
    if (isMountpoint(fuseDir)) spawnSync('fusermount3', ['-u', '-z', fuseDir], { stdio: 'ignore', timeout: 20_000 });
  };
  const unregister = onExitCleanup(undoSync, 'before');
  let tornDown = false;
  const teardown = async (): Promise<void> => {
    if (tornDown) return;
    tornDown = true;
    let error: Error | null = null;
    if (isMountpoint(mnt)) {
      try { await runCommand(['umount', mnt], { timeoutMs: 120_000 }); } catch (e) {
        error = e as Error;
        await runCommand(['umount', '-l', mnt], { timeoutMs: 20_000 }).catch(() => {});
      }
    }
    if (dev) await runCommand(['losetup', '-d', dev], { timeoutMs: 30_000 }).catch((e) => { error ??= e as Error; });
    if (isMountpoint(fuseDir)) {
      await runCommand(['fusermount3', '-u', fuseDir], { timeoutMs: 30_000 })
        .catch(() => runCommand(['fusermount3', '-u', '-z', fuseDir], { timeoutMs: 10_000 }).catch(() => {}));
    }
    const deadline = Date.now() + 15_000;
    while (fuseAlive() && Date.now() < deadline) await new Promise((res) => setTimeout(res, 50));
    if (fuseAlive()) { fuse.kill('SIGKILL'); await fuseExited; }
    unregister();
    if (error) throw error;
  };
  try {
    const deadline = Date.now() + 20_000;
    while (!fs.existsSync(file)) {
      if (!fuseAlive()) throw new Error(`nbdfuse exited early: ${fuseErr}`);
      if (Date.now() > deadline) throw new Error(`nbdfuse did not create ${file} in 20 s: ${fuseErr}`);
      await new Promise((res) => setTimeout(res, 20));
    }
    seconds.nbdfuse = since(t);
    t = performance.now();
    dev = (await runCommand(['losetup', '-f', '--show', file], { timeoutMs: 30_000 })).stdout.trim();
    if (!/^\/dev\/loop\d+$/.test(dev)) throw new Error(`losetup printed ${JSON.stringify(dev)}`);
    seconds.losetup = since(t);
    if (o.mkfs) {
      t = performance.now();
      await runCommand(['mkfs.ext4', '-q', '-F', ...(o.mkfsArgs ?? []), dev], { timeoutMs: 300_000 });
      seconds.mkfs = since(t);
    }
    t = performance.now();
    await runCommand(['mount', '-t', 'ext4', ...(o.mountOptions ? ['-o', o.mountOptions] : []), dev, mnt], { timeoutMs: 120_000 });
    seconds.mount = since(t);
  } catch (e) {
    await teardown().catch(() => {});
    throw e;
  }
  return { mnt, dev, seconds, teardown };
}

// ------------------------------------------------------------------ a minimal NBD client (time to first read, stall probe)

export interface FirstReadTimes {
  /** performance.now() when the socket connected, the handshake (OPT_GO) finished, the READ reply arrived. */
  connectedAt: number;
  goAt: number;
  readAt: number;
  data: Buffer;
}

/**
 * A minimal NBD client over a Unix socket: fixed newstyle, NBD_OPT_GO (no structured replies),
 * simple READs one at a time, DISC. Frames as in the NBD protocol spec (proto.md). For timing
 * what a server does when it is just starting, and for probing how long a busy server takes
 * to answer a trivial request (a stalled event loop shows up as a slow READ).
 */
export class NbdClient {
  private buf: Buffer = Buffer.alloc(0);
  private waiter: (() => void) | null = null;
  private failed: Error | null = null;
  private handle = 1n;
  connectedAt = NaN;
  goAt = NaN;

  private constructor(private readonly sock: net.Socket) {
    sock.on('data', (d: Buffer) => { this.buf = this.buf.length ? Buffer.concat([this.buf, d]) : d; this.waiter?.(); });
    sock.on('error', (e) => { this.failed = e; this.waiter?.(); });
    sock.on('close', () => { this.failed ??= new Error('nbd: server closed the connection'); this.waiter?.(); });
  }

  /** Connect (retrying every 5 ms until the socket accepts, up to timeoutMs) and negotiate `exportName`. */
  static async connect(socket: string, exportName: string, timeoutMs = 60_000): Promise<NbdClient> {
    const deadline = Date.now() + timeoutMs;
    let sock: net.Socket;
    for (;;) {
      const s = await new Promise<net.Socket | null>((resolve) => {
        const c = net.connect(socket);
        c.once('connect', () => { c.removeAllListeners('error'); resolve(c); });
        c.once('error', () => { c.destroy(); resolve(null); });
      });
      if (s) { sock = s; break; }
      if (Date.now() > deadline) throw new Error(`nbd: ${socket} did not accept a connection in ${timeoutMs} ms`);
      await new Promise((r) => setTimeout(r, 5));
    }
    const c = new NbdClient(sock);
    c.connectedAt = performance.now();
    try {
      await c.handshake(exportName, deadline);
    } catch (e) {
      sock.destroy();
      throw e;
    }
    c.goAt = performance.now();
    return c;
  }

  private async take(n: number, deadline: number): Promise<Buffer> {
    while (this.buf.length < n) {
      if (this.failed) throw this.failed;
      if (Date.now() > deadline) throw new Error('nbd: timed out waiting for the server');
      await new Promise<void>((res) => { this.waiter = res; setTimeout(res, 1000).unref(); });
      this.waiter = null;
    }
    const out = this.buf.subarray(0, n);
    this.buf = this.buf.subarray(n);
    return out;
  }

  private async handshake(exportName: string, deadline: number): Promise<void> {
    const greeting = await this.take(18, deadline);
    if (greeting.readBigUInt64BE(0) !== 0x4e42444d41474943n || greeting.readBigUInt64BE(8) !== 0x49484156454f5054n) throw new Error('nbd: not a newstyle server');
    const clientFlags = Buffer.alloc(4);
    clientFlags.writeUInt32BE(1 | 2, 0); // FIXED_NEWSTYLE | NO_ZEROES
    const name = Buffer.from(exportName);
    const data = Buffer.alloc(4 + name.length + 2);
    data.writeUInt32BE(name.length, 0);
    name.copy(data, 4);
    data.writeUInt16BE(0, 4 + name.length);
    const opt = Buffer.alloc(16);
    opt.writeBigUInt64BE(0x49484156454f5054n, 0);
    opt.writeUInt32BE(7, 8); // NBD_OPT_GO
    opt.writeUInt32BE(data.length, 12);
    this.sock.write(Buffer.concat([clientFlags, opt, data]));
    for (;;) {
      const h = await this.take(20, deadline);
      const type = h.readUInt32BE(12);
      const body = await this.take(h.readUInt32BE(16), deadline);
      if (type === 1) return; // ACK
      if (type & 0x80000000) throw new Error(`nbd: OPT_GO refused (0x${type.toString(16)}): ${body.toString('utf8')}`);
    }
  }

  /** One READ (nothing else in flight); resolves with the data when its reply arrived. */
  async read(offset: number, length: number, timeoutMs = 60_000): Promise<Buffer> {
    const deadline = Date.now() + timeoutMs;
    const req = Buffer.alloc(28);
    req.writeUInt32BE(0x25609513, 0);
    req.writeUInt16BE(0, 4);
    req.writeUInt16BE(0, 6); // READ
    req.writeBigUInt64BE(this.handle++, 8);
    req.writeBigUInt64BE(BigInt(offset), 16);
    req.writeUInt32BE(length, 24);
    this.sock.write(req);
    const rep = await this.take(16, deadline);
    if (rep.readUInt32BE(0) !== 0x67446698) throw new Error('nbd: unexpected reply magic');
    const err = rep.readUInt32BE(4);
    if (err !== 0) throw new Error(`nbd: READ failed, errno ${err}`);
    return Buffer.from(await this.take(length, deadline));
  }

  /** NBD_CMD_DISC and close. */
  close(): void {
    const disc = Buffer.alloc(28);
    disc.writeUInt32BE(0x25609513, 0);
    disc.writeUInt16BE(2, 6); // DISC
    disc.writeBigUInt64BE(this.handle++, 8);
    try { this.sock.end(disc); } catch { /* gone */ }
    setTimeout(() => this.sock.destroy(), 1000).unref();
  }
}

/**
 * Connect to a Unix-socket NBD server (retrying until it listens), negotiate `exportName`,
 * READ `length` bytes at `offset`, disconnect: the time to the first answered READ of a server
 * that is just starting.
 */
export async function nbdReadOnce(socket: string, exportName: string, offset: number, length: number, timeoutMs = 60_000): Promise<FirstReadTimes> {
  const c = await NbdClient.connect(socket, exportName, timeoutMs);
  try {
    const data = await c.read(offset, length, timeoutMs);
    return { connectedAt: c.connectedAt, goAt: c.goAt, readAt: performance.now(), data };
  } finally {
    c.close();
  }
}

export interface StallProbe {
  /** Stop probing; resolves with the latency (ms) of every probe READ. */
  stop(): Promise<number[]>;
}

/**
 * Every `intervalMs`, one 4 KiB READ at `offset` on its own connection, one at a time: how
 * long a server leaves a trivial request waiting while it is busy with something else (for a
 * single-threaded server, its longest event-loop stalls). Choose an offset that is never
 * written, so the READ needs no store or disk access.
 */
export async function startStallProbe(socket: string, exportName: string, offset: number, intervalMs = 50): Promise<StallProbe> {
  const c = await NbdClient.connect(socket, exportName, 30_000);
  const lat: number[] = [];
  let stopping = false;
  const loop = (async () => {
    while (!stopping) {
      const t = performance.now();
      try { await c.read(offset, 4096, 120_000); } catch { break; }
      lat.push(performance.now() - t);
      await new Promise((r) => setTimeout(r, intervalMs));
    }
  })();
  return {
    stop: async () => {
      stopping = true;
      await loop;
      c.close();
      return lat;
    },
  };
}

// ------------------------------------------------------------------ goals (issue targets, one row each)

/**
 * One goal of an issue, measured in this run: what baton did, what its peer did in the same
 * run (or nothing, for an absolute goal), the result (a ratio or a value) and the target.
 * Every scenario puts its rows in its JSON as `goals`; `bench/goals.ts` prints them all at
 * the end of `npm run bench`. `pass` is null when the row could not be measured.
 */
export interface GoalRow {
  goal: string;
  baton: string;
  peer: string;
  result: string;
  target: string;
  pass: boolean | null;
}

/** A throughput goal: baton ÷ peer at least `min`. */
export function ratioGoal(goal: string, batonValue: number | undefined, peerName: string, peerValue: number | undefined, unit: string, min: number): GoalRow {
  const r = ratio(batonValue, peerValue);
  return {
    goal, baton: `${fmt(batonValue)} ${unit}`, peer: `${peerName} ${fmt(peerValue)} ${unit}`,
    result: fmtRatio(r), target: `≥ ${min}×`, pass: Number.isFinite(r) ? r >= min : null,
  };
}

/** An absolute goal: `value` at most (or at least) `limit`. */
export function limitGoal(goal: string, value: number | undefined, unit: string, op: '≤' | '≥', limit: number, peer = ''): GoalRow {
  const ok = value !== undefined && Number.isFinite(value);
  return {
    goal, baton: `${fmt(value)} ${unit}`, peer, result: `${fmt(value)} ${unit}`, target: `${op} ${fmt(limit)} ${unit}`,
    pass: ok ? (op === '≤' ? value <= limit : value >= limit) : null,
  };
}

export function goalsTable(rows: GoalRow[]): string {
  const mark = (p: boolean | null): string => (p === null ? '?' : p ? '✓' : '✗');
  return markdownTable(['goal', 'baton', 'peer (same run)', 'result', 'target', ''],
    rows.map((g) => [g.goal, g.baton, g.peer, g.result, g.target, mark(g.pass)]), ['l', 'r', 'r', 'r', 'l', 'l']);
}

/** A time goal against a peer: baton's time ÷ the peer's at most `max` (a slowdown). */
export function slowdownGoal(goal: string, batonSeconds: number | undefined, peerName: string, peerSeconds: number | undefined, max: number): GoalRow {
  const r = ratio(batonSeconds, peerSeconds);
  return {
    goal, baton: `${fmt(batonSeconds)} s`, peer: `${peerName} ${fmt(peerSeconds)} s`,
    result: `${fmtRatio(r)} the time`, target: `≤ ${max}×`, pass: Number.isFinite(r) ? r <= max : null,
  };
}

// ------------------------------------------------------------------ serve --metrics

/** A TCP port nothing listens on now (for serve --metrics: the bench's log level hides the port serve would print). */
export function freeTcpPort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

/** What a scraper of serve --metrics saw. */
export interface ScrapeRecord {
  scrapes: number;
  errors: number;
  /** Time per scrape (request to last byte), ms. */
  msP50: number;
  msMax: number;
  /** Size of one /metrics answer, bytes (the last). */
  bytes: number;
  /** baton_nbd_requests_total summed over the last scrape: the counters were live. */
  requestsCounted: number;
}

export interface Scraper { stop(): Promise<ScrapeRecord> }

/** GET /metrics of 127.0.0.1:port every `everyMs` (as a Prometheus server would) until stopped; stop() scrapes once more and sums up. */
export function startMetricsScraper(port: number, everyMs: number): Scraper {
  const ms: number[] = [];
  let errors = 0;
  let last = '';
  let stopped = false;
  const get = (): Promise<string> => new Promise((resolve, reject) => {
    const req = http.get({ host: '127.0.0.1', port, path: '/metrics', agent: false }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => { body += d; });
      res.on('end', () => (res.statusCode === 200 ? resolve(body) : reject(new Error(`status ${res.statusCode}`))));
      res.on('error', reject);
    });
    req.on('error', reject);
    req.setTimeout(10_000, () => req.destroy(new Error('no answer in 10 s')));
  });
  const loop = (async () => {
    while (!stopped) {
      const t0 = performance.now();
      try {
        last = await get();
        ms.push(performance.now() - t0);
      } catch {
        errors++;
      }
      await new Promise((r) => setTimeout(r, everyMs));
    }
  })();
  return {
    async stop() {
      stopped = true;
      await loop;
      try { last = await get(); } catch { errors++; }
      let requestsCounted = 0;
      for (const line of last.split('\n')) if (line.startsWith('baton_nbd_requests_total{')) requestsCounted += Number(line.slice(line.lastIndexOf(' ') + 1));
      return { scrapes: ms.length, errors, msP50: median(ms), msMax: ms.length ? Math.max(...ms) : NaN, bytes: Buffer.byteLength(last), requestsCounted };
    },
  };
}
