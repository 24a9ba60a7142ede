/**
 * Soak: two `baton serve` hosts on one real Redis and one radosgw bucket, 8 volumes with 4 NBD
 * connections each under verifying workloads, a fork every minute, a round of handoffs between
 * the hosts every minute and background compaction + GC with a short grace, for a duration
 * given on the command line (default 10 minutes). Everything runs on loopback and Unix sockets
 * and is started and stopped here.
 *
 *   node dist/bench/soak.js [--duration 10m]
 *
 * Volumes (homes alternate between the hosts h0 and h1; every handoff round moves each one):
 *   f0..f2  fio, 4 jobs = 4 connections, each on its own quarter: random writes of 4-64 KiB with
 *           `--verify=crc32c --verify_backlog=16 --verify_fatal=1` (fio reads back every 16 writes
 *           what it wrote), `--fsync=32`, ~10 writes/s per job (`--rate`).
 *   w0..w3  the checksummed block model of test/helpers/writer.ts (self-describing 4 KiB blocks,
 *           per block the generation a FLUSH/FUA made durable and those that may have landed),
 *           driven here by a paced client on 4 connections: writes of 1-16 blocks (sometimes
 *           64-256), 5 % FUA, a FLUSH every 8 writes (on any connection: CAN_MULTI_CONN), and
 *           reads whose every block is checked against the model while the workload runs. After
 *           each handoff the whole volume is read back through the new holder and checked.
 *   e0      ext4 on nbdfuse (4 connections) + loop + mount: batches of new files of random
 *           content (4 KiB - 1 MiB, sha256 recorded), old files deleted to keep ~48 MiB live,
 *           `sync -f` after each batch. At each handoff: umount, `e2fsck -fn` (must be clean),
 *           detach, move, attach on the new holder, mount, and the whole tree checked: exactly
 *           the files that should be there, every checksum right.
 *
 * Every minute (at :00 of each minute of the run) a handoff round moves every volume to the other
 * host, 1 s apart, alternating the two ways a volume moves: `baton handoff NAME --to HOST` (the
 * holder drains under load: writes get ESHUTDOWN, its clients are disconnected, it flushes and
 * releases the lease reserved for the target) and an attach on the other host, which runs
 * `--on-held takeover` (it asks the holder for a handoff and waits for it). Clients follow the
 * volume: the block clients reconnect to the new holder (after the full read-back), fio is
 * restarted there (fio's nbd engine cannot reconnect), ext4 is remounted.
 *
 * Every minute (at :30) a fork of one of w0..w3, e0 (in turn) with `baton fork`, under load. The
 * fork is read through the other host at once and checked against what was acknowledged when the
 * fork started (every block: its acknowledged generation then, or one written during the fork;
 * for ext4: every file synced before the fork, intact, nothing deleted before it, `e2fsck` clean
 * after the journal replay), read again FORK_KEEP later, after several GC runs (the same bytes
 * must still be there), then removed with `baton rm`, which gives GC something to collect.
 *
 * Both hosts run the background pass: `--gc-interval` (compaction below 0.5, then GC) with
 * `--gc-grace` a few seconds, and every baton process (hosts, CLI) runs with the same lowered
 * BATON_MAX_OPERATION_MS (GC's grace must be at least twice it). Each server logs a `process
 * stats` line (`--stats-interval`: RSS, heap, event-loop delay p50/p99/max of the interval and
 * since start); the harness also samples VmRSS/VmHWM from /proc. At the end everything is
 * stopped gracefully and the block volumes and the ext4 tree are checked once more through a
 * third host with an empty cache (everything read from radosgw).
 *
 * Reported: verify failures (must be 0), unexpected errors (must be 0; the expected ones are
 * classified and counted, with how the clients retry), RSS and event-loop delay of each server,
 * forks and handoffs done, GC runs and bytes collected, load average. Results:
 * bench/results/soak.md and soak.json; the servers' logs in bench/results/soak-logs.raw/.
 *
 * Knobs (environment): DURATION (same as --duration), HANDOFF_EVERY (60s), FORK_EVERY (60s),
 * FORK_KEEP (120s), MAX_OP_MS (5000: BATON_MAX_OPERATION_MS), GC_GRACE (12s), GC_INTERVAL (20s),
 * LEASE_TTL (5 s, baton's default), STATS_INTERVAL (5s), RATE (1: multiplies every workload's
 * pace), SEED (1). Needs root (losetup, mount), redis-server, radosgw (scripts/rgw.sh), fio,
 * nbdfuse, e2fsprogs; exits 0 with a message without them.
 */

import { spawnSync, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { monitorEventLoopDelay, performance } from 'node:perf_hooks';
import { listAll } from '../src/store/object-store.js';
import { openStore } from '../src/store/open.js';
import { CMD, CMD_FLAG_FUA, ClosedError, RawClient, SIMPLE_REPLY_MAGIC, requestFrame } from '../test/helpers/nbd-raw.js';
import { BLOCK, BlockModel, allocBlocks, connectGo, decodeBlock, randInt, rngFrom, stampBlock, type Problem } from '../test/helpers/writer.js';
import {
  BATON_BIN, MiB, NbdClient, RESULTS_DIR, envNumber, fmt, has, machineInfo, makeTempDir, markdownTable, onExitCleanup, runCommand, shellQuote, spawnTracked,
  startBaton, startRgwBucket, writeResults, type CommandResult, type Server,
} from './lib.js';

// ------------------------------------------------------------------ configuration

function durationMs(v: string, what: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)?$/.exec(v.trim());
  if (!m) throw new Error(`${what}=${v}: not a duration (examples: 600, 90s, 10m)`);
  return Math.round(Number(m[1]) * { ms: 1, s: 1000, m: 60_000, h: 3_600_000 }[(m[2] ?? 's') as 'ms' | 's' | 'm' | 'h']);
}
function argValue(name: string): string | undefined {
  const i = process.argv.indexOf(name);
  if (i < 0) return undefined;
  const v = process.argv[i + 1];
  if (v === undefined) throw new Error(`${name} needs a value (for example ${name} 10m)`);
  return v;
}

const DURATION_MS = durationMs(argValue('--duration') ?? process.env.DURATION ?? '10m', '--duration');
const HANDOFF_EVERY_MS = durationMs(process.env.HANDOFF_EVERY ?? '60s', 'HANDOFF_EVERY');
const FORK_EVERY_MS = durationMs(process.env.FORK_EVERY ?? '60s', 'FORK_EVERY');
const FORK_KEEP_MS = durationMs(process.env.FORK_KEEP ?? '120s', 'FORK_KEEP');
const MAX_OP_MS = Math.floor(envNumber('MAX_OP_MS', 5000));
const GC_GRACE_MS = durationMs(process.env.GC_GRACE ?? '12s', 'GC_GRACE');
const GC_INTERVAL_MS = durationMs(process.env.GC_INTERVAL ?? '20s', 'GC_INTERVAL');
const LEASE_TTL_S = envNumber('LEASE_TTL', 5);
const STATS_INTERVAL_MS = durationMs(process.env.STATS_INTERVAL ?? '5s', 'STATS_INTERVAL');
const RATE = envNumber('RATE', 1);
const SEED = Math.floor(envNumber('SEED', 1)) >>> 0;
if (GC_GRACE_MS < 2 * MAX_OP_MS) throw new Error(`GC_GRACE (${GC_GRACE_MS} ms) must be at least twice MAX_OP_MS (${MAX_OP_MS} ms)`);

const IDLE_GRACE_S = 10;
const HELD_WAIT_S = 60;
const STAGGER_MS = 1000;
/** No new handoff round or fork this close to the end (they finish before the workloads stop). */
const QUIET_END_MS = 20_000;
const REPLY_TIMEOUT_MS = 60_000;

const MODEL_SIZE = 64 * MiB;
const MODEL_OPS_PER_S = 40 * RATE;
const FLUSH_EVERY = 8;
const READ_SHARE = 0.3;
const FUA_SHARE = 0.05;
const FIO_SIZE = 256 * MiB;
/** Bytes per second per fio job (~10 writes/s of 4-64 KiB): fio's --rate_iops with a block size range paces by the smallest size, so pace by bytes. */
const FIO_KIB_PER_S_PER_JOB = Math.max(4, Math.round(320 * RATE));
const EXT4_SIZE = 1024 * MiB;
const EXT4_LIVE_BYTES = 48 * MiB;
const EXT4_BATCH_EVERY_MS = 1000 / RATE;

const BUCKET = 'soak';
const STORE = `s3://${BUCKET}/run`;

// ------------------------------------------------------------------ bookkeeping

const T0 = performance.now();
const el = (t = performance.now()): number => (t - T0) / 1000;
const log = (s: string): void => { process.stderr.write(`[${el().toFixed(1).padStart(6)}s] ${s}\n`); };
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const errText = (e: unknown): string => (e instanceof Error ? e.message : String(e)).split('\n').slice(0, 6).join(' | ').slice(0, 600);

interface Issue { t: number; source: string; what: string }
const unexpected: Issue[] = [];
const verifyFailures: Issue[] = [];
let verifyFailureCount = 0;
const expected = new Map<string, number>();

function expectedError(category: string, n = 1): void { expected.set(category, (expected.get(category) ?? 0) + n); }
function unexpectedError(source: string, what: string): void {
  unexpected.push({ t: el(), source, what });
  log(`UNEXPECTED ${source}: ${what}`);
}
function verifyFailure(source: string, what: string): void {
  verifyFailureCount++;
  if (verifyFailures.length < 200) verifyFailures.push({ t: el(), source, what });
  if (verifyFailureCount <= 50) log(`VERIFY FAILURE ${source}: ${what}`);
}

/** What each expected category is and how the client involved goes on. */
const EXPECTED_NOTES: Record<string, string> = {
  'block client: write or flush refused with ESHUTDOWN during a handoff':
    'the holder is draining for a handoff; the write stays "may have landed" in the model (never retried under its generation), a refused FLUSH covers nothing; the client\'s connections are then closed by the server, it waits for the handoff, reads the whole volume back through the new holder and reconnects there',
  'block client: connection closed by the holder during a handoff':
    'what a handoff does to every client of the volume; the client reconnects to the new holder after the read-back (commands in flight count as "may have landed")',
  'fio: run cut off by a `baton handoff` (its connections closed)':
    'fio\'s nbd engine does not reconnect: the harness kills the run (it spins on "nbd_poll: nothing to poll for in state DEAD" or exits with ENOTCONN/ESHUTDOWN) and starts a new run on the new holder; blocks fio had not verified yet are not verified',
  'server: request refused with ESHUTDOWN while draining for a handoff (request failed, errno 108)':
    'the server side of the first category; logged at warn by nbd/session.ts',
  'server: background compaction skipped a volume that was being handed off':
    'the pass raced with a drain (ShutdownError); the new holder compacts it in its next pass',
  'ext4: `baton handoff` found the volume already closed (idle grace over)':
    'the filesystem is unmounted before its handoff, so its volume may have closed already; the next attach on the target takes it normally',
  'baton fork: took longer than the GC budget (M/2), undone and made again':
    'catalog.ts undoes a fork that landed too late for GC\'s safety argument and retries it; the CLI then succeeds',
};

const eldHarness = monitorEventLoopDelay({ resolution: 10 });
eldHarness.enable();

// ------------------------------------------------------------------ prerequisites

const TOOLS = ['redis-server', 'radosgw', 'fio', 'nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'mount', 'umount', 'sync'];
{
  const missing = TOOLS.filter((t) => !has(t));
  if (process.getuid?.() !== 0 || missing.length > 0) {
    process.stderr.write(`bench/soak: needs root and ${TOOLS.join(', ')}${missing.length ? ` (missing: ${missing.join(', ')})` : ' (not root)'}; skipped\n`);
    process.exit(0);
  }
}

const machine = machineInfo();
const loadSamples: { t: number; load: number[] }[] = [{ t: 0, load: os.loadavg().map((x) => Math.round(x * 100) / 100) }];
const root = makeTempDir('baton-soak-');
const rawDir = path.join(RESULTS_DIR, 'soak-logs.raw');
fs.rmSync(rawDir, { recursive: true, force: true });
fs.mkdirSync(rawDir, { recursive: true });
log(`soak: ${DURATION_MS / 1000} s, handoff round every ${HANDOFF_EVERY_MS / 1000} s, fork every ${FORK_EVERY_MS / 1000} s, M=${MAX_OP_MS} ms, GC every ${GC_INTERVAL_MS / 1000} s with grace ${GC_GRACE_MS / 1000} s, lease TTL ${LEASE_TTL_S} s; load average ${loadSamples[0]!.load.join(' ')}`);

// ------------------------------------------------------------------ redis and radosgw

const redisSock = path.join(root, 'redis.sock');
const redisUrl = `unix://${redisSock}`;
const redis = spawnTracked(['redis-server', '--port', '0', '--unixsocket', redisSock, '--unixsocketperm', '700', '--save', '', '--appendonly', 'no', '--dir', root, '--loglevel', 'warning'], { stdout: 'ignore' });
{
  const deadline = Date.now() + 10_000;
  for (;;) {
    try {
      if ((await runCommand(['redis-cli', '-s', redisSock, 'PING'], { timeoutMs: 2000 })).stdout.trim() === 'PONG') break;
    } catch { /* not up yet */ }
    if (Date.now() > deadline || redis.exitCode !== null) throw new Error('redis-server did not start');
    await sleep(50);
  }
}
const rgwDir = path.join(root, 'rgw');
const { rgw, version: rgwVersion, credentials: rgwCredentials } = await startRgwBucket(rgwDir, BUCKET);
log(`radosgw on ${rgw.endpoint}, redis on ${redisSock}`);

/** The environment of every baton process: the store's endpoint and credentials, and the same M. */
const batonEnv: NodeJS.ProcessEnv = { ...process.env, ...rgw.env, BATON_MAX_OPERATION_MS: String(MAX_OP_MS) };
const commands: { what: string; argv: string[] }[] = [];

async function batonCli(args: string[], timeoutMs = 120_000): Promise<CommandResult> {
  const argv = [process.execPath, BATON_BIN, ...args, '--store', STORE];
  if (!commands.some((c) => c.what === args[0])) commands.push({ what: args[0]!, argv });
  const r = await runCommand(argv, { env: batonEnv, timeoutMs });
  if (/fork took too long to trust against GC/.test(r.stderr)) expectedError('baton fork: took longer than the GC budget (M/2), undone and made again', (r.stderr.match(/fork took too long/g) ?? []).length);
  return r;
}

// ------------------------------------------------------------------ hosts

interface Host { id: string; server: Server; logFile: string; rss: { t: number; rssMiB: number; hwmMiB: number }[] }

function hostArgs(id: string): string[] {
  return [
    '--host-id', id, '--redis', redisUrl, '--lease-ttl', String(LEASE_TTL_S), '--on-held', 'takeover', '--held-wait', String(HELD_WAIT_S),
    '--idle-grace', String(IDLE_GRACE_S), '--gc-interval', `${GC_INTERVAL_MS}ms`, '--gc-grace', `${GC_GRACE_MS}ms`, '--stats-interval', `${STATS_INTERVAL_MS}ms`,
  ];
}

async function startHost(id: string): Promise<Host> {
  const dir = path.join(root, `host-${id}`);
  fs.mkdirSync(dir);
  const logFile = path.join(rawDir, `${id}.log`);
  const server = await startBaton({ dir, volume: 'NAME', size: 0, store: STORE, create: false, logLevel: 'info', env: batonEnv, logFile, extraArgs: hostArgs(id) });
  if (!commands.some((c) => c.what === 'serve')) commands.push({ what: 'serve', argv: server.argv });
  return { id, server, logFile, rss: [] };
}

function procStatusMiB(pid: number | undefined, field: 'VmRSS' | 'VmHWM'): number {
  if (pid === undefined) return NaN;
  try {
    const m = new RegExp(`^${field}:\\s+(\\d+) kB`, 'm').exec(fs.readFileSync(`/proc/${pid}/status`, 'utf8'));
    return m ? Number(m[1]) / 1024 : NaN;
  } catch { return NaN; }
}

function sampleRss(h: Host): void {
  h.rss.push({ t: el(), rssMiB: procStatusMiB(h.server.pid, 'VmRSS'), hwmMiB: procStatusMiB(h.server.pid, 'VmHWM') });
}

const uriOf = (h: Host, name: string): string => `nbd+unix:///${name}?socket=${h.server.socket}`;

// ------------------------------------------------------------------ small tools

interface Deferred<T = void> { promise: Promise<T>; resolve(v: T): void; done: boolean }
function deferred<T = void>(): Deferred<T> {
  let resolve!: (v: T) => void;
  const d: Deferred<T> = { promise: new Promise<T>((r) => { resolve = r; }), resolve: (v: T) => { d.done = true; resolve(v); }, done: false };
  return d;
}

async function withTimeout<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([p, new Promise<never>((_, rej) => { timer = setTimeout(() => rej(new Error(`${what}: not done within ${ms} ms`)), ms); })]);
  } finally {
    clearTimeout(timer);
  }
}

/** Spaces a volume's operations 1/rate apart across its connections (no credit is saved up while behind). */
class Pacer {
  private next = 0;
  constructor(private readonly perSecond: number) {}
  async take(): Promise<void> {
    const now = performance.now();
    const at = Math.max(now, this.next);
    this.next = at + 1000 / this.perSecond;
    if (at > now) await sleep(at - now);
  }
}

function isConnectionLoss(err: unknown): boolean {
  if (err instanceof ClosedError) return true;
  const code = typeof err === 'object' && err !== null && 'code' in err ? String((err as { code: unknown }).code) : '';
  return ['EPIPE', 'ECONNRESET', 'ERR_STREAM_DESTROYED', 'ERR_STREAM_WRITE_AFTER_END'].includes(code) || (err instanceof Error && /socket destroyed/.test(err.message));
}

async function reply(c: RawClient, cookie: bigint): Promise<number> {
  const r = await c.simpleReply(REPLY_TIMEOUT_MS);
  if (r.magic !== SIMPLE_REPLY_MAGIC) throw new Error(`bad reply magic 0x${r.magic.toString(16)}`);
  if (r.cookie !== cookie) throw new Error(`reply for cookie ${r.cookie}, expected ${cookie} (one request in flight per connection)`);
  return r.error;
}

/** Read `blocks` blocks from 0 through one connection, 64 at a time; `onBlock` sees each. */
async function readAll(c: RawClient, blocks: number, onBlock: (b: number, data: Buffer) => void): Promise<void> {
  const chunk = 64;
  let cookie = 1n;
  for (let start = 0; start < blocks; start += chunk) {
    const count = Math.min(chunk, blocks - start);
    const k = cookie++;
    await c.write(requestFrame({ type: CMD.READ, cookie: k, offset: BigInt(start * BLOCK), length: count * BLOCK }));
    const e = await reply(c, k);
    if (e !== 0) throw new Error(`READ of blocks ${start}..${start + count - 1} failed with errno ${e}`);
    const data = await c.read(count * BLOCK, REPLY_TIMEOUT_MS);
    for (let i = 0; i < count; i++) onBlock(start + i, data.subarray(i * BLOCK, (i + 1) * BLOCK));
  }
}

async function cliHandoff(name: string, to: Host): Promise<number> {
  const r = await batonCli(['handoff', name, '--to', to.id, '--redis', redisUrl, '--wait', '60'], 90_000);
  return Number(/in (\d+) ms/.exec(r.stdout)?.[1] ?? NaN);
}

type Method = 'cli' | 'attach';

interface HandoffRecord {
  round: number; volume: string; kind: string; from: string; to: string; method: Method; t: number;
  /** Request to: the CLI returned (released for the target) or the attach was answered (target serving). */
  triggerMs: number;
  /** Request to: the clients work on the new holder again (first acknowledged command, fio connected, ext4 verified and written). */
  resumedMs: number;
  ok: boolean;
  note?: string;
}

// ------------------------------------------------------------------ w*: the block model on 4 connections

interface ForkWindow { acked: Uint32Array; pending: (number[] | undefined)[]; during: Map<number, number[]> }
interface Move { to: number; triggered: Deferred; resumed: Deferred }
interface Session { host: Host; move: Move | null; over: boolean }

class ModelVolume {
  readonly kind = 'block model';
  readonly model: BlockModel;
  readonly blocks = MODEL_SIZE / BLOCK;
  private readonly busy: Uint8Array;
  private readonly windows = new Set<ForkWindow>();
  private readonly rng: () => number;
  private readonly pacer = new Pacer(MODEL_OPS_PER_S);
  private writesSinceFlush = 0;
  private flushInFlight = false;
  private move: Move | null = null;
  private stopping = false;
  private loop: Promise<void> | null = null;
  readonly st = {
    sessions: 0, writesOk: 0, writesFailed: 0, fuaOk: 0, bytesWritten: 0, readsOk: 0, blocksReadChecked: 0, flushesOk: 0, flushesFailed: 0,
    errnos: {} as Record<number, number>, fullReadBacks: 0, blocksReadBack: 0,
  };

  constructor(readonly name: string, public home: number, seed: number) {
    this.model = new BlockModel(this.blocks, (0x50a4 << 16 | seed) >>> 0);
    this.busy = new Uint8Array(this.blocks);
    this.rng = rngFrom(SEED * 1000 + seed);
  }

  start(): void { this.loop = this.run(); }

  private async run(): Promise<void> {
    while (!this.stopping) {
      const host = hosts[this.home]!;
      let reason: string;
      try {
        reason = await this.session(host);
      } catch (err) {
        reason = `failed: ${errText(err)}`;
      }
      this.model.serverLost();
      if (this.stopping && reason === 'stopped') break;
      const mv = this.move;
      if (mv) {
        if (reason === 'closed') expectedError('block client: connection closed by the holder during a handoff');
        else unexpectedError(this.name, `session on ${host.id} ended during a handoff with: ${reason}`);
        await mv.triggered.promise;
      } else if (!this.stopping) {
        unexpectedError(this.name, `session on ${host.id} ended without a handoff: ${reason}`);
        await sleep(1000);
      }
      if (this.stopping) break;
      await this.readBack(hosts[this.home]!, 'after the handoff');
    }
  }

  /** 4 connections to `host` until one ends (then all are dropped) or the run stops (final flush). */
  private async session(host: Host): Promise<string> {
    this.st.sessions++;
    const s: Session = { host, move: this.move, over: false };
    const clients: RawClient[] = [];
    try {
      for (let i = 0; i < 4; i++) clients.push((await connectGo(host.server.socket, this.name, 25)).client);
      const ends = await Promise.all(clients.map((c) => this.connLoop(c, s).finally(() => { s.over = true; })));
      if (ends.includes('closed') || ends.includes('lost')) return 'closed';
      // Stopping: a final FLUSH that covers every write replied to, then disconnect.
      for (let i = 0; i < 5 && !this.model.allRepliedCovered; i++) await this.flush(clients[0]!, BigInt(1_000_000 + i), s);
      if (!this.model.allRepliedCovered) unexpectedError(this.name, 'final FLUSH did not succeed in 5 tries');
      for (const c of clients) await c.disconnect().catch(() => {});
      return 'stopped';
    } finally {
      for (const c of clients) c.destroy();
    }
  }

  private async connLoop(c: RawClient, s: Session): Promise<string> {
    let cookie = 1n;
    try {
      while (!s.over && !this.stopping) {
        await this.pacer.take();
        if (s.over || this.stopping) break;
        if (this.writesSinceFlush >= FLUSH_EVERY && !this.flushInFlight) await this.flush(c, cookie++, s);
        else if (this.rng() < READ_SHARE) await this.read(c, cookie++, s);
        else await this.write(c, cookie++, s);
        if (c.closed && c.buffered === 0) return 'closed';
      }
      return 'over';
    } catch (err) {
      if (isConnectionLoss(err)) return 'lost';
      throw err;
    }
  }

  private pickExtent(maxRun: number): { start: number; count: number } | null {
    for (let tries = 0; tries < 16; tries++) {
      const big = this.rng() < 0.02;
      const count = big ? randInt(this.rng, 64, 256) : randInt(this.rng, 1, maxRun);
      const region = !big && this.rng() < 0.5 ? Math.max(1024, count) : this.blocks;
      const start = randInt(this.rng, 0, region - count);
      let free = true;
      for (let b = start; b < start + count; b++) if (this.busy[b]) { free = false; break; }
      if (free) return { start, count };
    }
    return null;
  }

  private acked(s: Session): void {
    if (s.move && !s.move.resumed.done) s.move.resumed.resolve();
  }

  private failed(errno: number, what: string, s: Session): void {
    this.st.errnos[errno] = (this.st.errnos[errno] ?? 0) + 1;
    if (errno === 108 && this.move && s.move !== this.move) expectedError('block client: write or flush refused with ESHUTDOWN during a handoff');
    else unexpectedError(this.name, `${what} failed with errno ${errno} on ${s.host.id}`);
  }

  private async write(c: RawClient, cookie: bigint, s: Session): Promise<void> {
    const e = this.pickExtent(16);
    if (!e) return;
    for (let b = e.start; b < e.start + e.count; b++) this.busy[b] = 1;
    try {
      const gen = this.model.nextGen++;
      const fua = this.rng() < FUA_SHARE;
      this.model.writeSent(e.start, e.count, gen);
      for (const w of this.windows) {
        for (let b = e.start; b < e.start + e.count; b++) {
          const l = w.during.get(b);
          if (l) l.push(gen); else w.during.set(b, [gen]);
        }
      }
      this.writesSinceFlush++;
      const payload = allocBlocks(e.count);
      for (let i = 0; i < e.count; i++) stampBlock(payload, i * BLOCK, e.start + i, gen, this.model.salt);
      await c.write(requestFrame({ type: CMD.WRITE, flags: fua ? CMD_FLAG_FUA : 0, cookie, offset: BigInt(e.start * BLOCK), length: payload.length }, payload));
      const errno = await reply(c, cookie);
      if (errno === 0) {
        this.model.writeReplied(e.start, e.count, gen, fua);
        this.st.writesOk++;
        if (fua) this.st.fuaOk++;
        this.st.bytesWritten += payload.length;
        this.acked(s);
      } else {
        this.st.writesFailed++;
        this.failed(errno, 'WRITE', s);
      }
    } finally {
      for (let b = e.start; b < e.start + e.count; b++) this.busy[b] = 0;
    }
  }

  private async flush(c: RawClient, cookie: bigint, s: Session): Promise<void> {
    this.flushInFlight = true;
    this.writesSinceFlush = 0;
    const id = this.model.flushSent();
    try {
      await c.write(requestFrame({ type: CMD.FLUSH, cookie, offset: 0n, length: 0 }));
      const errno = await reply(c, cookie);
      if (errno === 0) {
        this.model.flushAcked(id);
        this.st.flushesOk++;
        this.acked(s);
      } else {
        this.model.flushFailed(id);
        this.st.flushesFailed++;
        this.failed(errno, 'FLUSH', s);
      }
    } finally {
      this.flushInFlight = false;
    }
  }

  /**
   * A READ while the workload runs. Its blocks are busy meanwhile, so no write to them is in
   * flight: a correct server returns the newest generation replied to (or one that may have
   * landed); the model's allowed set at reply time is exact for that.
   */
  private async read(c: RawClient, cookie: bigint, s: Session): Promise<void> {
    const e = this.pickExtent(32);
    if (!e) return;
    for (let b = e.start; b < e.start + e.count; b++) this.busy[b] = 1;
    try {
      await c.write(requestFrame({ type: CMD.READ, cookie, offset: BigInt(e.start * BLOCK), length: e.count * BLOCK }));
      const errno = await reply(c, cookie);
      if (errno !== 0) { this.failed(errno, 'READ', s); return; }
      const data = await c.read(e.count * BLOCK, REPLY_TIMEOUT_MS);
      for (let i = 0; i < e.count; i++) {
        const p = this.model.check(e.start + i, data.subarray(i * BLOCK, (i + 1) * BLOCK));
        if ('kind' in p) verifyFailure(this.name, `live READ on ${s.host.id}: ${describe(p)}`);
      }
      this.st.readsOk++;
      this.st.blocksReadChecked += e.count;
      this.acked(s);
    } finally {
      for (let b = e.start; b < e.start + e.count; b++) this.busy[b] = 0;
    }
  }

  /** Every block through a new connection to `host`, checked against the model; then the model is what was read. */
  async readBack(host: Host, why: string): Promise<void> {
    const t0 = performance.now();
    let client: RawClient | null = null;
    try {
      client = (await connectGo(host.server.socket, this.name, 25)).client;
      const observed = new Uint32Array(this.blocks);
      let bad = 0;
      await readAll(client, this.blocks, (b, data) => {
        const r = this.model.check(b, data);
        if ('kind' in r) { bad++; verifyFailure(this.name, `read-back ${why} on ${host.id}: ${describe(r)}`); } else observed[b] = r.gen;
      });
      await client.disconnect().catch(() => {});
      this.st.fullReadBacks++;
      this.st.blocksReadBack += this.blocks;
      // What a new holder reads before anyone wrote to it is what its recovery found in the store.
      if (bad === 0) this.model.rebase(observed);
      log(`${this.name}: read back ${this.blocks} blocks ${why} on ${host.id}: ${bad === 0 ? 'all as acknowledged' : `${bad} BAD`} (${Math.round(performance.now() - t0)} ms)`);
    } catch (err) {
      unexpectedError(this.name, `read-back ${why} on ${host.id} failed: ${errText(err)}`);
    } finally {
      client?.destroy();
    }
  }

  async handoff(round: number, to: number, method: Method): Promise<HandoffRecord> {
    const rec: HandoffRecord = { round, volume: this.name, kind: this.kind, from: hosts[this.home]!.id, to: hosts[to]!.id, method, t: el(), triggerMs: NaN, resumedMs: NaN, ok: false };
    const t0 = performance.now();
    const mv: Move = { to, triggered: deferred(), resumed: deferred() };
    this.move = mv;
    this.home = to;
    try {
      if (method === 'cli') {
        await cliHandoff(this.name, hosts[to]!);
      } else {
        // An attach on the target: it runs --on-held takeover, so its GO is answered once the holder handed over.
        const probe = await NbdClient.connect(hosts[to]!.server.socket, this.name, HELD_WAIT_S * 1000 + 30_000);
        probe.close();
      }
      rec.triggerMs = performance.now() - t0;
    } catch (err) {
      unexpectedError(this.name, `handoff (${method}) to ${hosts[to]!.id} failed: ${errText(err)}`);
    } finally {
      mv.triggered.resolve();
    }
    try {
      await withTimeout(mv.resumed.promise, 120_000, `${this.name}: first acknowledged command on ${hosts[to]!.id}`);
      rec.resumedMs = performance.now() - t0;
      rec.ok = Number.isFinite(rec.triggerMs);
    } catch (err) {
      unexpectedError(this.name, errText(err));
    }
    this.move = null;
    return rec;
  }

  openForkWindow(): ForkWindow {
    const w: ForkWindow = { acked: this.model.acked.slice(), pending: this.model.pending.map((p) => (p ? [...p] : undefined)), during: new Map() };
    this.windows.add(w);
    return w;
  }

  closeForkWindow(w: ForkWindow): void { this.windows.delete(w); }

  /** Stop issuing, FLUSH until every write replied to is covered, disconnect. */
  async stop(): Promise<void> {
    this.stopping = true;
    await this.loop;
  }
}

function describe(p: Problem): string {
  return `block ${p.block}: ${p.kind}: ${p.detail}; allowed generations [${p.allowed.slice(0, 8).join(', ')}${p.allowed.length > 8 ? ', …' : ''}]`;
}

/**
 * A fork of a block-model volume, read in full through `host`: each block must hold what was
 * acknowledged when the fork started, or a generation that may have landed by then or was
 * written while the fork was made. With `same`, it must also hold exactly what the first check read.
 */
async function checkModelFork(src: ModelVolume, fork: string, w: ForkWindow, host: Host, same?: Uint32Array, control = false): Promise<{ bad: number; observed: Uint32Array; ms: number }> {
  const t0 = performance.now();
  const observed = new Uint32Array(src.blocks);
  let bad = 0;
  // control: a deliberately wrong window, to show the check can fail; its findings are counted, not reported.
  const fail = (b: number, what: string): void => { bad++; if (!control) verifyFailure(fork, `fork of ${src.name} on ${host.id}: block ${b}: ${what}`); };
  const { client } = await connectGo(host.server.socket, fork, 25);
  try {
    await readAll(client, src.blocks, (b, data) => {
      const allowed = [w.acked[b]!, ...(w.pending[b] ?? []), ...(w.during.get(b) ?? [])];
      const d = decodeBlock(data);
      let gen: number;
      if (d.kind === 'garbage') { fail(b, `garbage (${d.why})`); return; }
      if (d.kind === 'zero') {
        if (!allowed.some((g) => src.model.zeroGens.has(g))) { fail(b, `reads as zeroes; generation ${w.acked[b]} was acknowledged before the fork`); return; }
        gen = 0;
      } else {
        if (d.salt !== src.model.salt || d.index !== b) { fail(b, `holds block ${d.index} of salt ${d.salt.toString(16)} (misdirected or foreign)`); return; }
        if (!allowed.includes(d.gen)) { fail(b, `holds generation ${d.gen}; allowed [${allowed.slice(0, 8).join(', ')}] (acknowledged before the fork: ${w.acked[b]})`); return; }
        gen = d.gen;
      }
      observed[b] = gen;
      if (same && same[b] !== gen) fail(b, `held generation ${same[b]} at the first check, ${gen} now (nobody writes the fork)`);
    });
    await client.disconnect().catch(() => {});
  } finally {
    client.destroy();
  }
  return { bad, observed, ms: performance.now() - t0 };
}

// ------------------------------------------------------------------ f*: fio with verify

interface FioRun {
  host: string; startedAt: number; proc: ChildProcess; out: string[]; outBytes: number; deadLines: number; connected: number;
  connectedAll: Deferred; exited: Promise<{ code: number | null; signal: string | null }>;
  /** Why the harness ended it: 'cut' (a CLI handoff closed its connections), 'sigint' (attach handoff, final), or unset. */
  endedBy?: 'cut' | 'sigint';
  verifyLines: number;
}

interface FioRunRecord { host: string; seconds: number; endedBy: string; code: number | null; signal: string | null; writes: number; writeMiB: number; verifyReadMiB: number; syncs: number; errors: number[]; deadLines: number }

const FIO_VERIFY_LINE = /verify: |verify failed|bad magic header|bad header|crc32c: |err=84\b/i;

class FioVolume {
  readonly kind = 'fio verify';
  private cur: FioRun | null = null;
  readonly runs: FioRunRecord[] = [];
  private endAt = 0;

  constructor(readonly name: string, public home: number) {}

  start(endAt: number): void {
    this.endAt = endAt;
    this.cur = this.spawn(hosts[this.home]!);
  }

  private spawn(host: Host): FioRun {
    const runtime = Math.max(10, Math.ceil((this.endAt - performance.now()) / 1000) + 60);
    const argv = [
      'fio', `--name=${this.name}`, '--ioengine=nbd', `--uri=${uriOf(host, this.name)}`, '--rw=randwrite', '--bsrange=4k-64k',
      `--size=${FIO_SIZE / 4}`, '--numjobs=4', `--offset_increment=${FIO_SIZE / 4}`, '--iodepth=4', '--direct=1',
      '--verify=crc32c', '--verify_backlog=16', '--verify_fatal=1', '--verify_state_save=0', '--fsync=32', `--rate=${FIO_KIB_PER_S_PER_JOB}k,${FIO_KIB_PER_S_PER_JOB}k`,
      '--time_based', `--runtime=${runtime}`, '--output-format=json',
      // Jobs as threads of one process: a SIGKILL ends the whole run (forked jobs would live on).
      '--thread',
    ];
    if (!commands.some((c) => c.what === 'fio')) commands.push({ what: 'fio', argv });
    const proc = spawnTracked(argv, { cwd: root });
    const run: FioRun = {
      host: host.id, startedAt: performance.now(), proc, out: [], outBytes: 0, deadLines: 0, connected: 0, connectedAll: deferred(),
      exited: new Promise((res) => proc.once('close', (code, signal) => res({ code, signal }))), verifyLines: 0,
    };
    // fio's log lines and its JSON share the streams. A dead connection makes the nbd engine
    // print the same error in a loop, forever (fio 3.33, libnbd 1.14): counted, not kept.
    const onLine = (line: string): void => {
      if (line.includes('nothing to poll for in state DEAD')) {
        if (run.deadLines++ === 0) {
          if (run.endedBy !== 'cut') unexpectedError(this.name, `fio's connection to ${host.id} died outside a handoff`);
          proc.kill('SIGKILL');
        }
        return;
      }
      if (line.includes('connected to NBD server') && ++run.connected === 4) run.connectedAll.resolve();
      if (FIO_VERIFY_LINE.test(line)) {
        run.verifyLines++;
        verifyFailure(this.name, `fio on ${host.id}: ${line.trim()}`);
      }
      if (run.outBytes < 4 * MiB) { run.out.push(line); run.outBytes += line.length; }
    };
    for (const stream of [proc.stdout!, proc.stderr!]) {
      let rest = '';
      stream.on('data', (d: Buffer) => {
        const lines = (rest + d.toString()).split('\n');
        rest = lines.pop()!;
        for (const l of lines) onLine(l);
        if (rest.length > 65536) { onLine(rest); rest = ''; }
      });
      stream.on('end', () => { if (rest) onLine(rest); });
    }
    void run.exited.then((x) => this.finished(run, x));
    return run;
  }

  /** Classify how a run ended; parse fio's JSON report if it wrote one. */
  private finished(run: FioRun, x: { code: number | null; signal: string | null }): void {
    const text = run.out.join('\n');
    const start = text.indexOf('\n{');
    let jobs: { error?: number; write?: { io_bytes?: number; total_ios?: number }; read?: { io_bytes?: number }; sync?: { total_ios?: number } }[] = [];
    try { if (start >= 0 || text.startsWith('{')) jobs = (JSON.parse(text.slice(start >= 0 ? start + 1 : 0)) as { jobs: typeof jobs }).jobs ?? []; } catch { /* no (complete) report */ }
    const errors = jobs.map((j) => j.error ?? 0).filter((e) => e !== 0);
    const rec: FioRunRecord = {
      host: run.host, seconds: (performance.now() - run.startedAt) / 1000, endedBy: run.endedBy ?? 'itself', code: x.code, signal: x.signal,
      writes: jobs.reduce((n, j) => n + (j.write?.total_ios ?? 0), 0), writeMiB: jobs.reduce((n, j) => n + (j.write?.io_bytes ?? 0), 0) / MiB,
      verifyReadMiB: jobs.reduce((n, j) => n + (j.read?.io_bytes ?? 0), 0) / MiB, syncs: jobs.reduce((n, j) => n + (j.sync?.total_ios ?? 0), 0), errors, deadLines: run.deadLines,
    };
    this.runs.push(rec);
    if (errors.includes(84) && run.verifyLines === 0) verifyFailure(this.name, `fio on ${run.host} ended with EILSEQ (84): a verify failure`);
    const ioErrors = errors.filter((e) => e !== 84);
    if (run.endedBy === 'cut') {
      // ENOTCONN, ESHUTDOWN, EIO, EPIPE, ECONNRESET: what a client whose connections were closed sees.
      const odd = ioErrors.filter((e) => ![107, 108, 5, 32, 104].includes(e));
      if (odd.length) unexpectedError(this.name, `fio cut off by a handoff ended with errors ${odd.join(', ')}`);
      else expectedError('fio: run cut off by a `baton handoff` (its connections closed)');
    } else if (run.endedBy === 'sigint') {
      if (ioErrors.length || jobs.length !== 4) unexpectedError(this.name, `fio stopped with SIGINT on ${run.host}: ${jobs.length} job reports, errors [${ioErrors.join(', ')}], exit ${x.code ?? x.signal}`);
    } else {
      unexpectedError(this.name, `fio on ${run.host} ended by itself: exit ${x.code ?? x.signal}, errors [${errors.join(', ')}]: ${run.out.filter((l) => l.startsWith('fio:')).slice(-3).join(' | ')}`);
    }
  }

  private async stopRun(run: FioRun, why: 'cut' | 'sigint'): Promise<void> {
    run.endedBy = why;
    if (why === 'sigint') run.proc.kill('SIGINT');
    try {
      await withTimeout(run.exited, why === 'sigint' ? 30_000 : 10_000, `${this.name}: fio exit`);
    } catch {
      if (why === 'sigint') unexpectedError(this.name, `fio did not stop within 30 s of SIGINT; killed`);
      run.proc.kill('SIGKILL');
      await run.exited;
    }
  }

  async handoff(round: number, to: number, method: Method): Promise<HandoffRecord> {
    const rec: HandoffRecord = { round, volume: this.name, kind: this.kind, from: hosts[this.home]!.id, to: hosts[to]!.id, method, t: el(), triggerMs: NaN, resumedMs: NaN, ok: false };
    const t0 = performance.now();
    const old = this.cur!;
    try {
      if (method === 'cli') {
        // Under load: the holder closes fio's connections, then fio is killed (it cannot reconnect).
        old.endedBy = 'cut';
        this.home = to;
        await cliHandoff(this.name, hosts[to]!);
        rec.triggerMs = performance.now() - t0;
        await Promise.race([old.exited, sleep(5000)]);
        if (old.proc.exitCode === null && old.proc.signalCode === null) old.proc.kill('SIGKILL');
        await withTimeout(old.exited, 30_000, `${this.name}: the old fio run's exit`);
        this.cur = this.spawn(hosts[to]!);
      } else {
        // fio stops (its report says what it verified), then a new run on the target is the
        // attach that takes the volume over.
        await this.stopRun(old, 'sigint');
        this.home = to;
        this.cur = this.spawn(hosts[to]!);
      }
      await withTimeout(this.cur.connectedAll.promise, HELD_WAIT_S * 1000 + 30_000, `${this.name}: fio connected on ${hosts[to]!.id}`);
      if (method === 'attach') rec.triggerMs = performance.now() - t0;
      rec.resumedMs = performance.now() - t0;
      rec.ok = true;
    } catch (err) {
      unexpectedError(this.name, `handoff (${method}) to ${hosts[to]!.id} failed: ${errText(err)}`);
    }
    return rec;
  }

  async stop(): Promise<void> {
    if (this.cur) await this.stopRun(this.cur, 'sigint');
  }
}

// ------------------------------------------------------------------ e0: ext4 over nbdfuse + loop

interface FsStack { fuseDir: string; mnt: string; dev: string; fuse: ChildProcess; fuseExited: Promise<void>; unregister: () => void; mounted: boolean }

function isMountpoint(dir: string): boolean {
  const want = path.resolve(dir);
  try { return fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n').some((l) => l.split(' ')[4] === want); } catch { return false; }
}

/** nbdfuse (4 connections when the server has multi-conn) + losetup (+ mkfs) + mount; undone at exit if the run does not get there. */
async function attachFs(host: Host, name: string, tag: string, o: { mkfs?: boolean } = {}): Promise<FsStack> {
  const base = fs.mkdtempSync(path.join(root, `fs-${tag}-`));
  const fuseDir = path.join(base, 'fuse');
  const mnt = path.join(base, 'mnt');
  fs.mkdirSync(fuseDir);
  fs.mkdirSync(mnt);
  const fuse = spawnTracked(['nbdfuse', fuseDir, uriOf(host, name)], { detached: true, stdout: 'ignore' });
  let fuseErr = '';
  fuse.stderr!.on('data', (d: Buffer) => { fuseErr = (fuseErr + d.toString()).slice(-4096); });
  const fuseExited = new Promise<void>((res) => fuse.once('exit', () => res()));
  const s: FsStack = { fuseDir, mnt, dev: '', fuse, fuseExited, unregister: () => {}, mounted: false };
  s.unregister = onExitCleanup(() => {
    if (isMountpoint(mnt)) runSync('umount', ['-l', mnt]);
    if (s.dev) runSync('losetup', ['-d', s.dev]);
    if (isMountpoint(fuseDir)) runSync('fusermount3', ['-u', '-z', fuseDir]);
  }, 'before');
  try {
    const file = path.join(fuseDir, 'nbd');
    const deadline = Date.now() + HELD_WAIT_S * 1000 + 30_000;
    while (!fs.existsSync(file)) {
      if (fuse.exitCode !== null || fuse.signalCode !== null) throw new Error(`nbdfuse exited early: ${fuseErr}`);
      if (Date.now() > deadline) throw new Error(`nbdfuse did not create ${file}: ${fuseErr}`);
      await sleep(20);
    }
    s.dev = (await runCommand(['losetup', '-f', '--show', file], { timeoutMs: 30_000 })).stdout.trim();
    if (o.mkfs) await runCommand(['mkfs.ext4', '-q', '-F', s.dev], { timeoutMs: 300_000 });
    await runCommand(['mount', '-t', 'ext4', s.dev, mnt], { timeoutMs: 120_000 });
    s.mounted = true;
  } catch (err) {
    await detachFs(s).catch(() => {});
    throw err;
  }
  return s;
}

/** Last-resort cleanup at exit, which must be synchronous. */
function runSync(cmd: string, args: string[]): void {
  spawnSync(cmd, args, { stdio: 'ignore', timeout: 20_000 });
}

async function umountFs(s: FsStack): Promise<void> {
  if (!s.mounted) return;
  await runCommand(['umount', s.mnt], { timeoutMs: 120_000 });
  s.mounted = false;
}

/** `e2fsck -fn` of the (unmounted) device: exit 0 means clean. */
async function fsckFs(s: FsStack, source: string): Promise<boolean> {
  try {
    await runCommand(['e2fsck', '-fn', s.dev], { timeoutMs: 300_000 });
    return true;
  } catch (err) {
    verifyFailure(source, `e2fsck -fn ${s.dev}: ${errText(err)}`);
    return false;
  }
}

/** umount (if mounted), losetup -d, fusermount3 -u and wait for nbdfuse (it flushes and disconnects). */
async function detachFs(s: FsStack): Promise<void> {
  let error: unknown = null;
  if (s.mounted || isMountpoint(s.mnt)) {
    try { await umountFs(s); } catch (e) { error = e; await runCommand(['umount', '-l', s.mnt], { timeoutMs: 20_000 }).catch(() => {}); }
  }
  if (s.dev) await runCommand(['losetup', '-d', s.dev], { timeoutMs: 30_000 }).catch((e) => { error ??= e; });
  s.dev = '';
  if (isMountpoint(s.fuseDir)) {
    await runCommand(['fusermount3', '-u', s.fuseDir], { timeoutMs: 30_000 }).catch(() => runCommand(['fusermount3', '-u', '-z', s.fuseDir], { timeoutMs: 10_000 }).catch(() => {}));
  }
  try { await withTimeout(s.fuseExited, 20_000, 'nbdfuse exit'); } catch { s.fuse.kill('SIGKILL'); await s.fuseExited; }
  s.unregister();
  if (error) throw error;
}

interface FileRec { rel: string; size: number; sha: string; writtenAt: number; syncedAt?: number; unlinkAt?: number; unlinkSyncedAt?: number }

class Ext4Volume {
  readonly kind = 'ext4 tree';
  private stack: FsStack | null = null;
  readonly files = new Map<string, FileRec>();
  private seq = 0;
  private liveBytes = 0;
  private pause = false;
  private workload: Promise<void> | null = null;
  private readonly rng: () => number;
  readonly st = { batches: 0, filesWritten: 0, bytesWritten: 0, filesDeleted: 0, treeChecks: 0, filesChecked: 0, fscks: 0, mounts: 0 };

  constructor(readonly name: string, public home: number) { this.rng = rngFrom(SEED * 1000 + 77); }

  async start(): Promise<void> {
    this.stack = await attachFs(hosts[this.home]!, this.name, 'main', { mkfs: true });
    this.st.mounts++;
    this.resume();
  }

  private resume(): void {
    this.pause = false;
    this.workload = this.work().catch((err) => { unexpectedError(this.name, `ext4 workload: ${errText(err)}`); });
  }

  private async work(): Promise<void> {
    while (!this.pause) {
      const t = performance.now();
      await this.batch();
      const left = EXT4_BATCH_EVERY_MS - (performance.now() - t);
      if (left > 0 && !this.pause) await sleep(left);
    }
  }

  /** A few new files, old ones deleted past the live target, then `sync -f`: what the sync covered is durable. */
  private async batch(): Promise<void> {
    const mnt = this.stack!.mnt;
    const written: FileRec[] = [];
    const unlinked: FileRec[] = [];
    for (let i = randInt(this.rng, 1, 4); i > 0; i--) {
      const n = this.seq++;
      const size = Math.round(Math.exp(Math.log(4096) + this.rng() * (Math.log(MiB) - Math.log(4096))));
      const data = randomBytes(size);
      const rel = `d${n % 16}/f${n}.bin`;
      await fsp.mkdir(path.join(mnt, `d${n % 16}`), { recursive: true });
      const rec: FileRec = { rel, size, sha: createHash('sha256').update(data).digest('hex'), writtenAt: performance.now() };
      await fsp.writeFile(path.join(mnt, rel), data);
      this.files.set(rel, rec);
      written.push(rec);
      this.liveBytes += size;
      this.st.filesWritten++;
      this.st.bytesWritten += size;
    }
    const live = [...this.files.values()].filter((f) => f.unlinkAt === undefined);
    while (this.liveBytes > EXT4_LIVE_BYTES && live.length > 0) {
      const f = live.splice(randInt(this.rng, 0, live.length - 1), 1)[0]!;
      f.unlinkAt = performance.now();
      await fsp.rm(path.join(mnt, f.rel));
      this.liveBytes -= f.size;
      unlinked.push(f);
      this.st.filesDeleted++;
    }
    await runCommand(['sync', '-f', mnt], { timeoutMs: 120_000 });
    const now = performance.now();
    for (const f of written) f.syncedAt = now;
    for (const f of unlinked) f.unlinkSyncedAt = now;
    this.st.batches++;
    // Forget files deleted long ago (a fork window never reaches that far back).
    if (this.st.batches % 100 === 0) for (const [k, f] of this.files) if (f.unlinkSyncedAt !== undefined && now - f.unlinkSyncedAt > FORK_KEEP_MS + 10 * FORK_EVERY_MS) this.files.delete(k);
  }

  /**
   * The tree under `mnt` against the records: files that must be there (`must`) are, with their
   * checksum; files that must be gone are; with `exact`, nothing else is there either.
   */
  async checkTree(mnt: string, source: string, must: (f: FileRec) => boolean, gone: (f: FileRec) => boolean, exact: boolean): Promise<{ checked: number; bad: number }> {
    let checked = 0;
    let bad = 0;
    const fail = (what: string): void => { bad++; verifyFailure(source, what); };
    for (const f of this.files.values()) {
      const p = path.join(mnt, f.rel);
      if (must(f)) {
        let data: Buffer;
        try { data = await fsp.readFile(p); } catch (err) { fail(`${f.rel} (synced) is missing: ${errText(err)}`); continue; }
        const sha = createHash('sha256').update(data).digest('hex');
        if (data.length !== f.size || sha !== f.sha) fail(`${f.rel}: ${data.length} bytes, sha256 ${sha.slice(0, 16)}…; written ${f.size} bytes, ${f.sha.slice(0, 16)}…`);
        checked++;
      } else if (gone(f) && fs.existsSync(p)) {
        fail(`${f.rel} was deleted (and synced) but is there`);
      }
    }
    if (exact) {
      for (const d of await fsp.readdir(mnt)) {
        if (d === 'lost+found') continue;
        for (const e of await fsp.readdir(path.join(mnt, d))) {
          const f = this.files.get(`${d}/${e}`);
          if (!f || !must(f)) fail(`${d}/${e} is there but ${f ? 'was deleted' : 'was never written'}`);
        }
      }
    }
    return { checked, bad };
  }

  /** Every synced, undeleted file is there and intact, and nothing else (nothing is unsynced between batches). */
  private async checkLive(mnt: string, source: string): Promise<void> {
    const t0 = performance.now();
    const r = await this.checkTree(mnt, source, (f) => f.syncedAt !== undefined && f.unlinkAt === undefined, (f) => f.unlinkSyncedAt !== undefined, true);
    this.st.treeChecks++;
    this.st.filesChecked += r.checked;
    log(`${this.name}: checked the tree on ${source}: ${r.checked} files ${r.bad === 0 ? 'intact' : `${r.bad} BAD`} (${Math.round(performance.now() - t0)} ms)`);
  }

  private async unmountAndCheck(source: string): Promise<void> {
    const s = this.stack!;
    this.stack = null;
    await umountFs(s);
    this.st.fscks++;
    await fsckFs(s, `${this.name} ${source}`);
    await detachFs(s);
  }

  async handoff(round: number, to: number, method: Method): Promise<HandoffRecord> {
    const rec: HandoffRecord = { round, volume: this.name, kind: this.kind, from: hosts[this.home]!.id, to: hosts[to]!.id, method, t: el(), triggerMs: NaN, resumedMs: NaN, ok: false };
    const t0 = performance.now();
    try {
      this.pause = true;
      await this.workload;
      await this.unmountAndCheck(`before the handoff (on ${hosts[this.home]!.id})`);
      this.home = to;
      const tMove = performance.now();
      if (method === 'cli') {
        try {
          await cliHandoff(this.name, hosts[to]!);
        } catch (err) {
          if (/nobody holds/.test(errText(err))) { expectedError('ext4: `baton handoff` found the volume already closed (idle grace over)'); rec.note = 'already closed'; } else throw err;
        }
      }
      this.stack = await attachFs(hosts[to]!, this.name, `main${round}`);
      this.st.mounts++;
      rec.triggerMs = performance.now() - tMove;
      await this.checkLive(this.stack.mnt, `${hosts[to]!.id} after the handoff`);
      this.resume();
      rec.resumedMs = performance.now() - t0;
      rec.ok = true;
    } catch (err) {
      unexpectedError(this.name, `handoff (${method}) to ${hosts[to]!.id} failed: ${errText(err)}`);
    }
    return rec;
  }

  /** Fork window bounds: a fork taken between `from` and `to` (performance.now()). */
  async checkFork(fork: string, from: number, to: number, host: Host, tag: string): Promise<{ checked: number; bad: number; ms: number }> {
    const t0 = performance.now();
    const s = await attachFs(host, fork, tag);
    let r: { checked: number; bad: number };
    try {
      r = await this.checkTree(s.mnt, `${fork} (fork of ${this.name}) on ${host.id}`,
        (f) => f.syncedAt !== undefined && f.syncedAt < from && !(f.unlinkAt !== undefined && f.unlinkAt < to),
        (f) => f.unlinkSyncedAt !== undefined && f.unlinkSyncedAt < from, false);
      await umountFs(s);
      if (!(await fsckFs(s, `${fork} on ${host.id}`))) r.bad++;
    } finally {
      await detachFs(s);
    }
    return { ...r, ms: performance.now() - t0 };
  }

  /** Final: stop writing, unmount (fsck), so the cold check can mount it elsewhere. */
  async stop(): Promise<void> {
    this.pause = true;
    await this.workload;
    if (this.stack) await this.unmountAndCheck(`at the end (on ${hosts[this.home]!.id})`);
  }

  async coldCheck(host: Host): Promise<void> {
    const s = await attachFs(host, this.name, 'cold');
    try {
      await this.checkLive(s.mnt, `${host.id} (cold, empty cache)`);
      await umountFs(s);
      await fsckFs(s, `${this.name} on ${host.id}`);
    } finally {
      await detachFs(s);
    }
  }
}

// ------------------------------------------------------------------ setup

const VOLS: { name: string; size: number; kind: 'fio' | 'model' | 'ext4'; home: number }[] = [
  { name: 'f0', size: FIO_SIZE, kind: 'fio', home: 0 }, { name: 'f1', size: FIO_SIZE, kind: 'fio', home: 1 }, { name: 'f2', size: FIO_SIZE, kind: 'fio', home: 1 },
  { name: 'w0', size: MODEL_SIZE, kind: 'model', home: 0 }, { name: 'w1', size: MODEL_SIZE, kind: 'model', home: 1 },
  { name: 'w2', size: MODEL_SIZE, kind: 'model', home: 0 }, { name: 'w3', size: MODEL_SIZE, kind: 'model', home: 1 },
  { name: 'e0', size: EXT4_SIZE, kind: 'ext4', home: 0 },
];
await Promise.all(VOLS.map((v) => batonCli(['create', v.name, '--size', String(v.size)])));
const hosts: Host[] = [await startHost('h0'), await startHost('h1')];
log(`hosts h0 (pid ${hosts[0]!.server.pid}) and h1 (pid ${hosts[1]!.server.pid}) listening; ${VOLS.length} volumes created`);

const models = VOLS.filter((v) => v.kind === 'model').map((v, i) => new ModelVolume(v.name, v.home, i + 1));
const fios = VOLS.filter((v) => v.kind === 'fio').map((v) => new FioVolume(v.name, v.home));
const ext4 = new Ext4Volume('e0', VOLS.find((v) => v.kind === 'ext4')!.home);
const all: (ModelVolume | FioVolume | Ext4Volume)[] = [...fios, ...models, ext4];

await ext4.start();
const workStart = performance.now();
const endAt = workStart + DURATION_MS;
for (const m of models) m.start();
for (const f of fios) f.start(endAt);
log('workloads running');

// ------------------------------------------------------------------ forks

interface ForkRecord {
  n: number; source: string; name: string; t: number; printedMs: number; wallMs: number; ok: boolean;
  checks: { t: number; host: string; blocksOrFiles: number; bad: number; ms: number }[]; removed: boolean; rmMs?: number;
}
interface PendingFork { rec: ForkRecord; dueAt: number; src: ModelVolume | Ext4Volume; window?: ForkWindow; observed?: Uint32Array; from: number; to: number }
const forks: ForkRecord[] = [];
interface NegativeControl { fork: string; badBlocks: number; of: number }
let negativeControl: NegativeControl | null = null;
const pendingForks: PendingFork[] = [];
const forkSources: (ModelVolume | Ext4Volume)[] = [models[0]!, ext4, models[1]!, models[2]!, models[3]!];

async function checkFork(p: PendingFork, host: Host, again: boolean): Promise<void> {
  try {
    if (p.src instanceof ModelVolume) {
      const r = await checkModelFork(p.src, p.rec.name, p.window!, host, again ? p.observed : undefined);
      p.observed ??= r.observed;
      p.rec.checks.push({ t: el(), host: host.id, blocksOrFiles: p.src.blocks, bad: r.bad, ms: r.ms });
      if (again && !negativeControl) {
        // Negative control, once: the same fork against a window opened now. Blocks acknowledged
        // since the fork must show up as "older than acknowledged"; if none do, the check is blind.
        const now = p.src.openForkWindow();
        p.src.closeForkWindow(now);
        const c = await checkModelFork(p.src, p.rec.name, now, host, undefined, true);
        negativeControl = { fork: p.rec.name, badBlocks: c.bad, of: p.src.blocks };
        log(`fork ${p.rec.name}: negative control (checked against a window opened now): ${c.bad} blocks flagged`);
        if (c.bad === 0) unexpectedError(p.rec.name, 'negative control: the fork check flagged nothing against a window opened after the fork (the check cannot fail?)');
      }
    } else {
      const r = await p.src.checkFork(p.rec.name, p.from, p.to, host, `${p.rec.name}-${again ? 2 : 1}`);
      p.rec.checks.push({ t: el(), host: host.id, blocksOrFiles: r.checked, bad: r.bad, ms: r.ms });
    }
    const c = p.rec.checks[p.rec.checks.length - 1]!;
    log(`fork ${p.rec.name}: ${again ? 'checked again' : 'checked'} on ${host.id}: ${c.blocksOrFiles} ${p.src instanceof ModelVolume ? 'blocks' : 'files'}, ${c.bad === 0 ? 'all as expected' : `${c.bad} BAD`} (${Math.round(c.ms)} ms)`);
  } catch (err) {
    unexpectedError(p.rec.name, `fork check on ${host.id} failed: ${errText(err)}`);
  }
}

async function forkOnce(n: number): Promise<void> {
  const src = forkSources[n % forkSources.length]!;
  const name = `${src.name}-fork${n}`;
  const rec: ForkRecord = { n, source: src.name, name, t: el(), printedMs: NaN, wallMs: NaN, ok: false, checks: [], removed: false };
  forks.push(rec);
  const window = src instanceof ModelVolume ? src.openForkWindow() : undefined;
  const from = performance.now();
  try {
    const r = await batonCli(['fork', src.name, name, '--json']);
    rec.printedMs = (JSON.parse(r.stdout) as { ms: number }).ms;
    rec.wallMs = r.seconds * 1000;
    rec.ok = true;
  } catch (err) {
    unexpectedError(name, `baton fork ${src.name} ${name} failed: ${errText(err)}`);
  } finally {
    if (window && src instanceof ModelVolume) src.closeForkWindow(window);
  }
  const to = performance.now();
  if (!rec.ok) return;
  log(`fork ${name} of ${src.name} (served by ${hosts[src.home]!.id}) in ${rec.printedMs} ms (process ${Math.round(rec.wallMs)} ms)`);
  const p: PendingFork = { rec, dueAt: performance.now() + FORK_KEEP_MS, src, ...(window ? { window } : {}), from, to };
  await checkFork(p, hosts[1 - src.home]!, false);
  pendingForks.push(p);
}

/** Read the fork again (on the host that did not check it first), then `baton rm` it once its server closed it. */
async function recheckAndRemove(p: PendingFork): Promise<void> {
  const first = p.rec.checks[0]?.host;
  await checkFork(p, hosts.find((h) => h.id !== first) ?? hosts[0]!, true);
  const t0 = performance.now();
  for (let attempt = 0; ; attempt++) {
    try {
      await batonCli(['rm', p.rec.name, '--redis', redisUrl]);
      p.rec.removed = true;
      p.rec.rmMs = performance.now() - t0;
      log(`fork ${p.rec.name}: removed`);
      return;
    } catch (err) {
      // Refused while a host still serves it: the fork closes IDLE_GRACE_S after its reader left.
      if (/being served by/.test(errText(err)) && attempt < 60) { await sleep(1000); continue; }
      unexpectedError(p.rec.name, `baton rm: ${errText(err)}`);
      return;
    }
  }
}

// ------------------------------------------------------------------ the schedule

const handoffs: HandoffRecord[] = [];
let rounds = 0;
let lateRounds = 0;
let lateForks = 0;

async function handoffRound(round: number): Promise<void> {
  const method: Method = round % 2 === 1 ? 'cli' : 'attach';
  log(`handoff round ${round} (${method === 'cli' ? '`baton handoff`' : 'attach with --on-held takeover'}): every volume to the other host`);
  const recs = await Promise.all(all.map(async (v, i) => {
    await sleep(i * STAGGER_MS);
    return v.handoff(round, 1 - v.home, method);
  }));
  handoffs.push(...recs);
  const ok = recs.filter((r) => r.ok);
  log(`handoff round ${round} done: ${ok.length}/${recs.length} moved; request → clients working again: median ${fmt(median(ok.map((r) => r.resumedMs)))} ms, worst ${fmt(Math.max(...ok.map((r) => r.resumedMs)))} ms`);
}

function median(xs: number[]): number {
  const v = xs.filter(Number.isFinite).sort((a, b) => a - b);
  if (v.length === 0) return NaN;
  const m = Math.floor(v.length / 2);
  return v.length % 2 ? v[m]! : (v[m - 1]! + v[m]!) / 2;
}

{
  let nextHandoff = workStart + HANDOFF_EVERY_MS;
  let nextFork = workStart + FORK_EVERY_MS / 2;
  let nextSample = workStart;
  let nextLoad = workStart + 60_000;
  let handoffLane: Promise<void> | null = null;
  let forkLane: Promise<void> | null = null;
  /** Second reads and removals of older forks: their own lane (a removal waits out the fork's idle grace). */
  let recheckLane: Promise<void> | null = null;
  let forkN = 0;
  while (performance.now() < endAt) {
    const now = performance.now();
    const quiet = now > endAt - QUIET_END_MS;
    if (now >= nextHandoff) {
      nextHandoff += HANDOFF_EVERY_MS;
      if (quiet) { /* too close to the end */ } else if (handoffLane) { lateRounds++; log('handoff round skipped: the previous one is still running'); } else {
        const r = ++rounds;
        handoffLane = handoffRound(r).catch((err) => unexpectedError('schedule', `handoff round ${r}: ${errText(err)}`)).finally(() => { handoffLane = null; });
      }
    }
    if (now >= nextFork) {
      nextFork += FORK_EVERY_MS;
      if (quiet) { /* too close to the end */ } else if (forkLane) { lateForks++; log('fork skipped: the previous fork lane is still busy'); } else {
        const n = forkN++;
        forkLane = forkOnce(n).catch((err) => unexpectedError('schedule', `fork ${n}: ${errText(err)}`)).finally(() => { forkLane = null; });
      }
    }
    if (!recheckLane && !quiet && pendingForks.length > 0 && pendingForks[0]!.dueAt <= now) {
      const p = pendingForks.shift()!;
      recheckLane = recheckAndRemove(p).catch((err) => unexpectedError('schedule', `fork ${p.rec.name}: ${errText(err)}`)).finally(() => { recheckLane = null; });
    }
    if (now >= nextSample) { nextSample += 5000; for (const h of hosts) sampleRss(h); }
    if (now >= nextLoad) { nextLoad += 60_000; loadSamples.push({ t: el(), load: os.loadavg().map((x) => Math.round(x * 100) / 100) }); log(`load average ${loadSamples[loadSamples.length - 1]!.load.join(' ')}`); }
    await sleep(200);
  }
  log('time is up: waiting for the running handoff round and forks');
  await handoffLane;
  await forkLane;
  await recheckLane;
}

// ------------------------------------------------------------------ the end: stop, check everything once more, cold

const workSeconds = (performance.now() - workStart) / 1000;
log('stopping the workloads (final FLUSH, fio SIGINT, ext4 sync + umount + fsck)');
await Promise.all(all.map((v) => v.stop().catch((err) => unexpectedError(v.name, `stop: ${errText(err)}`))));
for (const m of models) await m.readBack(hosts[m.home]!, 'at the end');
while (pendingForks.length > 0) await recheckAndRemove(pendingForks.shift()!);
loadSamples.push({ t: el(), load: os.loadavg().map((x) => Math.round(x * 100) / 100) });
const hwm = hosts.map((h) => { sampleRss(h); return procStatusMiB(h.server.pid, 'VmHWM'); });
const lsEnd = JSON.parse((await batonCli(['ls', '--json'])).stdout) as { name: string; storedBytes?: number; writtenBytes?: number }[];
for (const h of hosts) await h.server.stop(30_000);
const exits = hosts.map((h) => h.server.status());
for (const [i, h] of hosts.entries()) if (exits[i] !== 'exit 0') unexpectedError(h.id, `baton serve ended with ${exits[i]} after SIGTERM`);
log(`hosts stopped (${exits.join(', ')}); checking every block volume and the ext4 tree through a new host with an empty cache`);
const checker = await startHost('check');
for (const m of models) await m.readBack(checker, 'cold, on a new host');
await ext4.coldCheck(checker).catch((err) => unexpectedError(ext4.name, `cold check: ${errText(err)}`));
await checker.server.stop(30_000);

// ------------------------------------------------------------------ the servers' logs

interface StatsLine { t: number; rss: number; heapUsed: number; eldP50Ms: number; eldP99Ms: number; eldMaxMs: number; eldP99SinceStartMs: number; eldMaxSinceStartMs: number; cpuPct: number }
interface HostReport {
  id: string; stats: StatsLine[];
  gc: { runs: number; deletingRuns: number; deletedObjects: number; deletedBytes: number; markedObjects: number; failedDeletes: number; maxStoredBytes: number; lastStoredBytes: number; lastReferencedBytes: number };
  compactions: { count: number; objects: number; objectBytes: number; rewritten: number };
  counts: Record<string, number>;
  levels: Record<string, number>;
}

function parseHostLog(h: Host): HostReport {
  const r: HostReport = {
    id: h.id, stats: [], gc: { runs: 0, deletingRuns: 0, deletedObjects: 0, deletedBytes: 0, markedObjects: 0, failedDeletes: 0, maxStoredBytes: 0, lastStoredBytes: 0, lastReferencedBytes: 0 },
    compactions: { count: 0, objects: 0, objectBytes: 0, rewritten: 0 }, counts: {}, levels: {},
  };
  const t0 = Date.now() - performance.now() + T0; // wall clock of T0
  for (const line of fs.readFileSync(h.logFile, 'utf8').split('\n')) {
    let j: Record<string, unknown>;
    try { j = JSON.parse(line) as Record<string, unknown>; } catch { continue; }
    const msg = String(j.msg ?? '');
    const level = Number(j.level);
    const t = (Number(j.time) - t0) / 1000;
    r.levels[level] = (r.levels[level] ?? 0) + 1;
    if (['volume opened', 'volume closed', 'volume handed off', 'lease acquired', 'handoff requested', 'volume recovered', 'takeover record committed'].includes(msg)) r.counts[msg] = (r.counts[msg] ?? 0) + 1;
    if (msg === 'process stats') r.stats.push({ t, ...(j as unknown as Omit<StatsLine, 't'>) });
    if (msg === 'gc: done') {
      const n = (k: string): number => Number(j[k] ?? 0);
      r.gc.runs++;
      if (n('deletedObjects') > 0) r.gc.deletingRuns++;
      r.gc.deletedObjects += n('deletedObjects');
      r.gc.deletedBytes += n('deletedBytes');
      r.gc.markedObjects += n('markedObjects');
      r.gc.failedDeletes += n('failedDeletes');
      r.gc.maxStoredBytes = Math.max(r.gc.maxStoredBytes, n('storedBytes'));
      r.gc.lastStoredBytes = n('storedBytes');
      r.gc.lastReferencedBytes = n('referencedBytes');
    }
    if (msg === 'compacted' && Number(j.objects) > 0) {
      r.compactions.count++;
      r.compactions.objects += Number(j.objects);
      r.compactions.objectBytes += Number(j.objectBytes);
      r.compactions.rewritten += Number(j.rewritten);
    }
    if (level >= 40) classifyServerLine(h.id, level, msg, j);
  }
  return r;
}

function classifyServerLine(host: string, level: number, msg: string, j: Record<string, unknown>): void {
  const err = String(j.err ?? j.reason ?? '');
  if (msg === 'request failed' && Number(j.errno) === 108) { expectedError('server: request refused with ESHUTDOWN while draining for a handoff (request failed, errno 108)'); return; }
  if (msg.startsWith('background compaction failed') && /being handed to another host/.test(err)) { expectedError('server: background compaction skipped a volume that was being handed off'); return; }
  const key = `${host} log: ${level >= 50 ? 'error' : 'warn'}: ${msg}${err ? `: ${err.slice(0, 300)}` : ''}`;
  const first = serverIssues.get(key);
  if (first) first.count++;
  else serverIssues.set(key, { t: (Number(j.time) - (Date.now() - performance.now() + T0)) / 1000, count: 1, volume: String(j.volume ?? '') });
}
/** Unclassified warn/error lines of the servers, by message (one unexpected error each, with its count). */
const serverIssues = new Map<string, { t: number; count: number; volume: string }>();

// What radosgw itself saw: bytes put, what is left, and the DELETEs of volume objects (both
// hosts run GC; a DELETE of a key that is gone still succeeds, so the hosts' own counts can overlap).
const rgwCounters = await rgw.counters();
const storeLeft = await (async () => {
  // With the run's settings, as every baton process of it (the store records them and refuses another value).
  const st = openStore(STORE, { endpoint: rgw.endpoint, credentials: rgwCredentials, settings: { maxOperationMs: MAX_OP_MS } });
  try {
    const objs = await listAll(st, '');
    const vol = objs.filter((o) => o.key.startsWith('vol/'));
    return { objects: objs.length, bytes: objs.reduce((n, o) => n + o.size, 0), volObjects: vol.length, volBytes: vol.reduce((n, o) => n + o.size, 0) };
  } finally {
    await st.close();
  }
})();
const rgwDeletes = (await rgw.requestsSince(0)).filter((r) => r.method === 'DELETE' && r.path.includes('/vol/'));
const deleteStats = { requests: rgwDeletes.length, distinctKeys: new Set(rgwDeletes.map((r) => r.path)).size };

const reports = [...hosts, checker].map(parseHostLog);
for (const [key, v] of serverIssues) unexpected.push({ t: v.t, source: key.slice(0, key.indexOf(' log:') + 4), what: `${key.slice(key.indexOf(' log:') + 6)} (${v.count}×${v.volume ? `, first on ${v.volume}` : ''})` });
if (serverIssues.size > 0) log(`servers logged ${serverIssues.size} kinds of unclassified warn/error lines (in the report)`);

// ------------------------------------------------------------------ report

const workReport = {
  models: models.map((m) => ({ name: m.name, ...m.st, pendingBlocksAtEnd: m.model.pendingBlocks() })),
  fio: fios.map((f) => ({
    name: f.name, runs: f.runs.length, runsCutByHandoff: f.runs.filter((r) => r.endedBy === 'cut').length,
    writes: f.runs.reduce((n, r) => n + r.writes, 0), writeMiB: f.runs.reduce((n, r) => n + r.writeMiB, 0), verifyReadMiB: f.runs.reduce((n, r) => n + r.verifyReadMiB, 0),
    syncs: f.runs.reduce((n, r) => n + r.syncs, 0), runList: f.runs,
  })),
  ext4: ext4.st,
};

const stat = (xs: number[]): { min: number; max: number; last: number } => ({ min: Math.min(...xs), max: Math.max(...xs), last: xs[xs.length - 1] ?? NaN });
/** Least-squares slope of y over t, per minute. */
function slopePerMin(pts: { t: number; y: number }[]): number {
  if (pts.length < 3) return NaN;
  const n = pts.length;
  const mt = pts.reduce((a, p) => a + p.t, 0) / n;
  const my = pts.reduce((a, p) => a + p.y, 0) / n;
  const num = pts.reduce((a, p) => a + (p.t - mt) * (p.y - my), 0);
  const den = pts.reduce((a, p) => a + (p.t - mt) ** 2, 0);
  return den === 0 ? NaN : (num / den) * 60;
}

const hostSummaries = reports.slice(0, 2).map((r, i) => {
  const s = r.stats;
  const rss = s.map((x) => x.rss / MiB);
  const secondHalf = s.filter((x) => x.t >= el(workStart) + workSeconds / 2 && x.t <= el(workStart) + workSeconds);
  const last = s[s.length - 1];
  return {
    id: r.id, samples: s.length, rssMiB: stat(rss), peakRssMiB: hwm[i]!, rssSlopeSecondHalfMiBPerMin: slopePerMin(secondHalf.map((x) => ({ t: x.t, y: x.rss / MiB }))),
    heapUsedMiB: stat(s.map((x) => x.heapUsed / MiB)),
    eldMaxMs: last?.eldMaxSinceStartMs ?? NaN, eldP99Ms: last?.eldP99SinceStartMs ?? NaN,
    eldIntervalP99Ms: { median: median(s.map((x) => x.eldP99Ms)), worst: Math.max(...s.map((x) => x.eldP99Ms)) },
    cpuPctMean: s.reduce((a, x) => a + x.cpuPct, 0) / Math.max(1, s.length),
    gc: r.gc, compactions: r.compactions, counts: r.counts, exit: exits[i],
  };
});

const harnessEld = { p99Ms: Math.max(0, eldHarness.percentile(99) / 1e6 - 10), maxMs: Math.max(0, eldHarness.max / 1e6 - 10) };
const hOk = handoffs.filter((h) => h.ok);
const forksOk = forks.filter((f) => f.ok);
const forkChecks = forks.flatMap((f) => f.checks);
const gcTotal = {
  runs: reports.reduce((n, r) => n + r.gc.runs, 0), deletingRuns: reports.reduce((n, r) => n + r.gc.deletingRuns, 0),
  deletedObjects: reports.reduce((n, r) => n + r.gc.deletedObjects, 0), deletedBytes: reports.reduce((n, r) => n + r.gc.deletedBytes, 0),
  failedDeletes: reports.reduce((n, r) => n + r.gc.failedDeletes, 0),
};
const compTotal = { count: reports.reduce((n, r) => n + r.compactions.count, 0), rewritten: reports.reduce((n, r) => n + r.compactions.rewritten, 0), objectBytes: reports.reduce((n, r) => n + r.compactions.objectBytes, 0) };
const storedEnd = lsEnd.reduce((n, v) => n + (v.storedBytes ?? 0), 0);
const loads = loadSamples.map((l) => l.load[0]!);
const pass = verifyFailureCount === 0 && unexpected.length === 0;

const mib = (b: number): string => fmt(b / MiB);
/** Set by a fork check (in an async function, which TypeScript's narrowing does not see). */
const nc = negativeControl as NegativeControl | null;
/** A count: whole, with thousands separators. */
const int = (x: number): string => (Number.isFinite(x) ? Math.round(x).toLocaleString('en-US') : '–');
const cmdLine = `node dist/bench/soak.js --duration ${DURATION_MS >= 60_000 && DURATION_MS % 60_000 === 0 ? `${DURATION_MS / 60_000}m` : `${DURATION_MS / 1000}s`}`;
const md: string[] = [
  '# Soak: two hosts, Redis + radosgw, 8 volumes × 4 connections, forks, handoffs, GC',
  '',
  `${machine.date}, ${machine.nproc} cores (${machine.cpuModel}), ${machine.memTotalGiB} GiB, node ${machine.node}, ${machine.fio ?? 'fio ?'}, ${rgwVersion}, baton ${machine.batonCommit ?? '?'} (+ working tree).`,
  `**Load average (1 min)** at the start ${loadSamples[0]!.load.join(' / ')}, during the run ${fmt(Math.min(...loads))}–${fmt(Math.max(...loads))} (mean ${fmt(loads.reduce((a, b) => a + b, 0) / loads.length)}), at the end ${loadSamples[loadSamples.length - 1]!.load.join(' / ')}: the machine is shared with other jobs.`,
  '',
  `Command: \`${cmdLine}\`${RATE !== 1 ? ` (RATE=${RATE})` : ''}. Workloads ran ${fmt(workSeconds)} s. Hosts: \`baton serve ${hostArgs('hN').join(' ')} --store ${STORE} --log-level info\`, every baton process with BATON_MAX_OPERATION_MS=${MAX_OP_MS}.`,
  '',
  `**Result: ${pass ? 'PASS' : 'FAIL'}** — verify failures: **${verifyFailureCount}**, unexpected errors: **${unexpected.length}**.`,
  '',
  '## Summary',
  '',
  markdownTable(['measure', 'value'], [
    ['verify failures (live reads, read-backs after handoffs and at the end, fio verify, ext4 tree + e2fsck, forks)', String(verifyFailureCount)],
    ['unexpected errors (client side + server warn/error lines not classified below)', String(unexpected.length)],
    ['handoff rounds / volume handoffs done (of attempted)', `${rounds} / ${hOk.length} (of ${handoffs.length}); skipped rounds: ${lateRounds}`],
    ['handoff: request → clients working on the new holder, median / worst, ms (block volumes include the full read-back)', `${fmt(median(hOk.map((h) => h.resumedMs)))} / ${fmt(Math.max(...hOk.map((h) => h.resumedMs)))}`],
    ['handoff: request → released / target serving, median / worst, ms (`baton handoff` includes node start-up)', `${fmt(median(hOk.map((h) => h.triggerMs)))} / ${fmt(Math.max(...hOk.map((h) => h.triggerMs)))}`],
    ['forks done (of attempted) / fork checks (bad)', `${forksOk.length} (of ${forks.length}) / ${forkChecks.length} (${forkChecks.filter((c) => c.bad > 0).length}); skipped: ${lateForks}; removed: ${forks.filter((f) => f.removed).length}`],
    ['fork check, negative control (a block fork read against a window opened at its second check)', nc ? `${int(nc.badBlocks)} of ${int(nc.of)} blocks flagged (${nc.fork}): the check can fail` : 'not run'],
    ['`baton fork` printed ms, median / worst', `${fmt(median(forksOk.map((f) => f.printedMs)))} / ${fmt(Math.max(...forksOk.map((f) => f.printedMs)))}`],
    ['GC runs (both hosts) / runs that deleted / deletes the runs counted (objects, bytes)', `${gcTotal.runs} / ${gcTotal.deletingRuns} / ${int(gcTotal.deletedObjects)}, ${mib(gcTotal.deletedBytes)} MiB${gcTotal.failedDeletes ? ` (${gcTotal.failedDeletes} failed deletes)` : ''}`],
    ['radosgw: DELETE requests for volume objects / distinct keys deleted', `${int(deleteStats.requests)} / ${int(deleteStats.distinctKeys)}`],
    ['radosgw: bytes put / left in the bucket at the end (of which vol/) → collected', `${mib(rgwCounters.putBytes)} / ${mib(storeLeft.bytes)} (${mib(storeLeft.volBytes)}) MiB → ${mib(rgwCounters.putBytes - storeLeft.bytes)} MiB`],
    ['background compactions that rewrote something / live bytes rewritten / object bytes freed for GC', `${compTotal.count} / ${mib(compTotal.rewritten)} MiB / ${mib(compTotal.objectBytes)} MiB`],
    ['store at the end (`baton ls` stored bytes, all volumes)', `${mib(storedEnd)} MiB`],
    ['harness event-loop delay p99 / max, ms', `${fmt(harnessEld.p99Ms)} / ${fmt(harnessEld.maxMs)}`],
  ], ['l', 'r']),
  '## Servers',
  '',
  `From each server's \`process stats\` line (every ${STATS_INTERVAL_MS / 1000} s; event-loop delay = how late perf_hooks' 10 ms timer ran) and /proc (VmHWM = peak RSS).`,
  '',
  markdownTable(['host', 'RSS min / max / end, MiB', 'peak RSS (VmHWM), MiB', 'RSS slope, 2nd half, MiB/min', 'heap used max, MiB', 'event-loop delay p99 / max over the run, ms', 'worst 5-s p99, ms', 'CPU mean', 'GC runs / deleted', 'exit'],
    hostSummaries.map((h) => [
      h.id, `${fmt(h.rssMiB.min)} / ${fmt(h.rssMiB.max)} / ${fmt(h.rssMiB.last)}`, fmt(h.peakRssMiB), fmt(h.rssSlopeSecondHalfMiBPerMin), fmt(h.heapUsedMiB.max),
      `${fmt(h.eldP99Ms)} / ${fmt(h.eldMaxMs)}`, fmt(h.eldIntervalP99Ms.worst), `${fmt(h.cpuPctMean)} %`, `${h.gc.runs} / ${mib(h.gc.deletedBytes)} MiB`, h.exit ?? '',
    ]), ['l', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'l']),
  '## Workloads',
  '',
  markdownTable(['volume', 'what', 'done', 'checked'], [
    ...workReport.models.map((m) => [m.name, 'block model, 4 connections', `${int(m.writesOk)} writes (${mib(m.bytesWritten)} MiB, ${int(m.fuaOk)} FUA), ${int(m.flushesOk)} flushes, ${m.sessions} sessions`, `${int(m.readsOk)} live reads (${int(m.blocksReadChecked)} blocks), ${m.fullReadBacks} full read-backs (${int(m.blocksReadBack)} blocks)`]),
    ...workReport.fio.map((f) => [f.name, 'fio --verify=crc32c, 4 jobs', `${f.runs} runs (${f.runsCutByHandoff} cut by a handoff), ${int(f.writes)} writes / ${mib(f.writeMiB * MiB)} MiB and ${int(f.syncs)} fsyncs in the runs that reported`, `${mib(f.verifyReadMiB * MiB)} MiB read back by fio's verify (reported runs)`]),
    ['e0', 'ext4 on nbdfuse + loop', `${int(ext4.st.batches)} batches, ${int(ext4.st.filesWritten)} files (${mib(ext4.st.bytesWritten)} MiB) written, ${int(ext4.st.filesDeleted)} deleted, ${ext4.st.mounts} mounts`, `${ext4.st.treeChecks} whole-tree checks (${int(ext4.st.filesChecked)} files), ${ext4.st.fscks} e2fsck -fn`],
  ]),
  '## Errors',
  '',
  'Expected (classified), with how the client goes on:',
  '',
  markdownTable(['category', 'count', 'what happens'], [...expected.entries()].map(([k, n]) => [k, int(n), EXPECTED_NOTES[k] ?? ''])),
  unexpected.length === 0 ? 'Unexpected: none.' : `Unexpected (${unexpected.length}):\n\n${markdownTable(['t, s', 'source', 'what'], unexpected.slice(0, 100).map((u) => [fmt(u.t), u.source, u.what]))}`,
  '',
  verifyFailureCount === 0 ? 'Verify failures: none.' : `Verify failures (${verifyFailureCount}, first ${verifyFailures.length}):\n\n${markdownTable(['t, s', 'source', 'what'], verifyFailures.slice(0, 50).map((u) => [fmt(u.t), u.source, u.what]))}`,
  '',
  '## Handoffs',
  '',
  markdownTable(['round', 'method', 'volumes moved', 'request → released/serving, median / worst ms', 'request → clients working, median / worst ms'],
    [...new Set(handoffs.map((h) => h.round))].map((r) => {
      const hs = handoffs.filter((h) => h.round === r);
      const ok = hs.filter((h) => h.ok);
      return [String(r), hs[0]!.method === 'cli' ? '`baton handoff`' : 'attach (takeover)', `${ok.length}/${hs.length}`, `${fmt(median(ok.map((h) => h.triggerMs)))} / ${fmt(Math.max(...ok.map((h) => h.triggerMs)))}`, `${fmt(median(ok.map((h) => h.resumedMs)))} / ${fmt(Math.max(...ok.map((h) => h.resumedMs)))}`];
    }), ['r', 'l', 'r', 'r', 'r']),
  '## Forks',
  '',
  markdownTable(['fork', 'at, s', '`baton fork` ms (process)', 'checks (host: blocks or files, bad, ms)', 'removed'],
    forks.map((f) => [f.name, fmt(f.t), `${fmt(f.printedMs)} (${fmt(f.wallMs)})`, f.checks.map((c) => `${c.host}: ${c.blocksOrFiles}, ${c.bad}, ${fmt(c.ms)}`).join('; '), f.removed ? 'yes' : 'no'])),
  '## Commands',
  '',
  ...commands.map((c) => `- ${c.what}: \`${shellQuote(c.argv).replace(new RegExp(root.replace(/[.*+?^${}()|[\]\\]/g, '\\$&'), 'g'), '$TMP')}\``),
  '',
];
const out = writeResults('soak', md.join('\n'), {
  machine, config: { DURATION_MS, HANDOFF_EVERY_MS, FORK_EVERY_MS, FORK_KEEP_MS, MAX_OP_MS, GC_GRACE_MS, GC_INTERVAL_MS, LEASE_TTL_S, STATS_INTERVAL_MS, RATE, SEED, IDLE_GRACE_S, hostArgs: hostArgs('hN') },
  pass, verifyFailureCount, verifyFailures, unexpected, expected: Object.fromEntries(expected), loadSamples, workSeconds,
  hosts: hostSummaries, hostStats: reports.map((r) => ({ id: r.id, levels: r.levels, stats: r.stats })), rssSamples: hosts.map((h) => ({ id: h.id, rss: h.rss })),
  handoffs, forks, negativeControl, gc: gcTotal, rgwCounters, storeLeft, deleteStats, compactions: compTotal, storedBytesEnd: storedEnd, ls: lsEnd, workloads: workReport, harnessEld, commands,
});
process.stdout.write(md.join('\n') + '\n');
log(`wrote ${out.md} and ${out.json}`);
await rgw.stop();
redis.kill('SIGTERM');
process.exit(pass ? 0 : 1);
