/**
 * The single-writer lease end to end: real `baton serve` processes (each its own "host", with
 * its own --host-id and --cache-dir) on one store, a real redis-server, real NBD clients.
 *
 * The claim under test (src/exports.ts, Volume.takeover in src/volume/volume.ts): Redis decides
 * who SHOULD write, the store decides who CAN. A new holder commits a takeover record at the
 * next log position (create-only); an older holder's next commit finds its position taken and
 * fails (EIO), and a holder that cannot renew stops acknowledging before its lease can expire.
 * So whatever Redis or the hosts do, no acknowledged FLUSH is lost and nothing a stale holder
 * writes after a takeover ever lands.
 *
 * Scenarios: graceful handoff under a checksummed writer (file: and radosgw), crash takeover of
 * an ext4 + git workspace, a paused holder (SIGSTOP; also paused in the middle of a commit), a
 * holder partitioned from Redis (a TCP proxy that blackholes its connection), 8 racing
 * acquirers (Redis and the embedded lease), Redis FLUSHALL and restart under a writer, and the
 * embedded lease (no --redis).
 *
 * Besides reading the volume back through a fresh server, every scenario audits the store's
 * log directly (auditLog): each commit record must carry the token of the takeover record
 * before it. Replay skips fenced records, so a read-back alone could not see one that landed.
 *
 * Two bugs found on the way (`baton handoff`'s wait loop; a race in the file: store's delete)
 * are fixed; their reproductions stay at the end as ordinary tests.
 *
 * Lease TTL: BATON_LEASE_TEST_TTL seconds (default 2). Timings (handoff stall, kill -> serving)
 * are logged; the bounds asserted are generous, since CI machines are shared and slow.
 */

import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { performance } from 'node:perf_hooks';
import { openStore } from '../../src/store/open.js';
import { listAll } from '../../src/store/object-store.js';
import { decodeLogHeader, decodeVolumeRecord, keys } from '../../src/volume/format.js';
import { attachLoop, mountExt4, run, runOk, sha256, sha256File, startNbdfuse, type RunResult } from '../helpers/ext4.js';
import { CMD, ClosedError, FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, RawClient, SIMPLE_REPLY_MAGIC, clientFlagsFrame } from '../helpers/nbd-raw.js';
import { hasRedis, startRedis, startTcpProxy, type CutMode, type RedisServer } from '../helpers/redis.js';
import { hasRgw, makeTestBucket, s3TestEnv } from '../helpers/s3.js';
import { BATON_BIN, baton, has, startBatonServer, tempDir, type BatonServer } from '../helpers/server.js';
import {
  BLOCK, BlockModel, allocBlocks, decodeBlock, describeProblems, rngFrom, runWriter, stampBlock, verifyVolume,
  type Decoded, type WriterEvent, type WriterOptions, type WriterStats,
} from '../helpers/writer.js';

const TTL_S = Number(process.env.BATON_LEASE_TEST_TTL ?? 2);
const TTL_MS = TTL_S * 1000;
const SEED = process.env.BATON_LEASE_SEED !== undefined ? Number(process.env.BATON_LEASE_SEED) >>> 0 : randomBytes(4).readUInt32BE(0);
console.log(`lease: seed ${SEED} (rerun with BATON_LEASE_SEED=${SEED}), lease TTL ${TTL_S} s`);

const VOL = 'w';
const VOL_SIZE = 16 * 1024 * 1024;
const BLOCKS = VOL_SIZE / BLOCK;
const ESHUTDOWN = 108;

const haveRedis = hasRedis();
if (!haveRedis) console.warn('lease: redis-server not installed; the Redis scenarios are skipped');
const serialRedis = haveRedis ? test.serial : test.serial.skip;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const now = (): number => performance.now();

// ------------------------------------------------------------------ stores and hosts

interface Target {
  label: string;
  store: string;
  /** Environment for every baton process (S3 credentials). */
  env: Record<string, string>;
  s3?: { endpoint: string; accessKeyId: string; secretAccessKey: string; region: string };
}

function fileTarget(t: ExecutionContext): Target {
  return { label: 'file:', store: `file:${path.join(tempDir(t, 'baton-lease-store-'), 'store')}`, env: {} };
}

async function rgwTarget(t: ExecutionContext): Promise<Target> {
  const e = await s3TestEnv(t);
  const bucket = await makeTestBucket(e);
  return {
    label: 'rgw',
    store: `s3://${bucket}/lease`,
    env: { AWS_ACCESS_KEY_ID: e.accessKeyId, AWS_SECRET_ACCESS_KEY: e.secretAccessKey, AWS_REGION: e.region, BATON_S3_ENDPOINT: e.endpoint },
    s3: e,
  };
}

function createVolume(target: Target, name = VOL, size = VOL_SIZE): void {
  const r = baton(['create', name, '--size', String(size), '--store', target.store], target.env);
  if (r.status !== 0) throw new Error(`baton create failed: ${r.stderr}`);
}

interface HostOptions {
  /** Redis URL; null: the embedded lease (no --redis). */
  redis: string | null;
  onHeld?: 'refuse' | 'wait' | 'takeover';
  idleGrace?: number;
  env?: Record<string, string>;
}

/** One "host": `baton serve --host-id ID` with its own cache dir. */
async function host(t: ExecutionContext, target: Target, id: string, o: HostOptions): Promise<BatonServer> {
  const cache = path.join(tempDir(t, 'baton-cache-'), 'cache');
  const args = [
    '--host-id', id, '--lease-ttl', String(TTL_S), '--cache-dir', cache, '--idle-grace', String(o.idleGrace ?? 0.5),
    '--on-held', o.onHeld ?? 'refuse', '--held-wait', '20', ...(o.redis ? ['--redis', o.redis] : []),
  ];
  // Two hosts starting at once on one file: store used to fail each other's startup probe
  // (the delete race, fixed; its reproduction is the last test here): no retry needed.
  return startBatonServer(t, { store: target.store, extraArgs: args, env: { ...target.env, ...o.env } });
}

/** `baton ARGS` without blocking the event loop (a writer may be running meanwhile). */
function batonAsync(args: string[], env: Record<string, string> = {}): Promise<RunResult> {
  return run(process.execPath, [BATON_BIN, ...args], { env, timeoutMs: 60_000 });
}

function tail(s: string, lines = 25): string {
  return s.split('\n').slice(-lines).join('\n');
}

/** A baton log line's msg fields, for "did it say X" checks. */
function logMessages(server: BatonServer): string[] {
  const out: string[] = [];
  for (const line of server.stderr().split('\n')) {
    try { out.push(String((JSON.parse(line) as { msg?: unknown }).msg)); } catch { /* not JSON */ }
  }
  return out;
}

// ------------------------------------------------------------------ a small block client

type Result = number | 'closed';

/** One NBD connection writing stamped blocks (test/helpers/writer.ts format) one command at a time. */
class BlockClient {
  private cookie = 1n;
  constructor(readonly c: RawClient, readonly salt: number) {}

  /** Connect and GO; resolves to the client, or to the server's refusal message. */
  static async attach(socket: string, salt: number, name = VOL): Promise<BlockClient | { refused: string }> {
    const c = await RawClient.connect(socket);
    try {
      await c.handshakeGo(name);
    } catch (err) {
      c.destroy();
      const msg = err instanceof Error ? err.message : String(err);
      if (/GO .* failed/.test(msg)) return { refused: msg };
      throw err;
    }
    return new BlockClient(c, salt);
  }

  static async attachOk(socket: string, salt: number, name = VOL): Promise<BlockClient> {
    const r = await BlockClient.attach(socket, salt, name);
    if (!(r instanceof BlockClient)) throw new Error(`attach to ${socket} refused: ${r.refused}`);
    return r;
  }

  private async simple(frame: () => Promise<void>): Promise<Result> {
    try {
      await frame();
      const h = await this.c.read(16, 60_000);
      if (h.readUInt32BE(0) !== SIMPLE_REPLY_MAGIC) throw new Error('bad reply magic');
      return h.readUInt32BE(4);
    } catch (err) {
      if (err instanceof ClosedError || this.c.closed || /socket destroyed|EPIPE|ECONNRESET/.test(String(err))) return 'closed';
      throw err;
    }
  }

  /** Write blocks [start, start+count) at generation `gen`. */
  write(start: number, count: number, gen: number): Promise<Result> {
    const data = allocBlocks(count);
    for (let i = 0; i < count; i++) stampBlock(data, i * BLOCK, start + i, gen, this.salt);
    return this.simple(async () => {
      const h = Buffer.alloc(28);
      h.writeUInt32BE(0x25609513, 0);
      h.writeUInt16BE(0, 4);
      h.writeUInt16BE(CMD.WRITE, 6);
      h.writeBigUInt64BE(this.cookie++, 8);
      h.writeBigUInt64BE(BigInt(start * BLOCK), 16);
      h.writeUInt32BE(data.length, 24);
      await this.c.write(Buffer.concat([h, data]));
    });
  }

  flush(): Promise<Result> {
    return this.simple(async () => {
      const h = Buffer.alloc(28);
      h.writeUInt32BE(0x25609513, 0);
      h.writeUInt16BE(CMD.FLUSH, 6);
      h.writeBigUInt64BE(this.cookie++, 8);
      await this.c.write(h);
    });
  }

  async close(): Promise<void> {
    await this.c.disconnect().catch(() => {});
    this.c.destroy();
  }
}

/** Read blocks [start, start+count) through a fresh connection and decode each. */
async function readBlocks(socket: string, start: number, count: number, name = VOL): Promise<Decoded[]> {
  const c = await RawClient.connect(socket);
  try {
    await c.handshakeGo(name);
    const { reply, data } = await c.readAt(1n, BigInt(start * BLOCK), count * BLOCK);
    if (!data) throw new Error(`READ failed with errno ${reply.error}`);
    const out: Decoded[] = [];
    for (let i = 0; i < count; i++) out.push(decodeBlock(data.subarray(i * BLOCK, (i + 1) * BLOCK)));
    await c.disconnect().catch(() => {});
    return out;
  } finally {
    c.destroy();
  }
}

const show = (d: Decoded): string => (d.kind === 'block' ? `salt ${d.salt.toString(16)} gen ${d.gen}` : d.kind === 'zero' ? 'zero' : `garbage (${d.why})`);

/** Expect block `b` to read as (salt, gen), or zero when gen is 0. */
function expectBlock(t: ExecutionContext, got: Decoded, b: number, salt: number, gen: number, why: string): void {
  const ok = gen === 0 ? got.kind === 'zero' : got.kind === 'block' && got.index === b && got.salt === salt && got.gen === gen;
  t.true(ok, `block ${b}: ${why}: want ${gen === 0 ? 'zero' : `salt ${salt.toString(16)} gen ${gen}`}, got ${show(got)}`);
}

// ------------------------------------------------------------------ the store-level audit

interface LogEntry { seq: number; kind: 'commit' | 'takeover'; token: number; extents: number }

/** Every log record of a volume, straight from the store (no replay, nothing skipped). */
async function readLog(target: Target, name = VOL): Promise<LogEntry[]> {
  const store = openStore(target.store, target.s3 ? {
    endpoint: target.s3.endpoint, region: target.s3.region,
    credentials: { accessKeyId: target.s3.accessKeyId, secretAccessKey: target.s3.secretAccessKey },
  } : {});
  const rec = decodeVolumeRecord(await store.get(keys.volumeRecord(name)), name);
  const out: LogEntry[] = [];
  for (const o of await listAll(store, keys.logPrefix(rec.id))) {
    const { header } = decodeLogHeader(await store.get(o.key), o.key);
    out.push({ seq: header.seq, kind: header.kind, token: header.token, extents: header.extents.length });
  }
  return out;
}

/**
 * The fence, checked at the store: takeover tokens strictly grow, and every commit record
 * carries the token of the takeover record right before it (a commit with an older token
 * landed after a newer holder took over: a stale writer got through).
 */
async function auditLog(t: ExecutionContext, target: Target, name = VOL): Promise<LogEntry[]> {
  const log = await readLog(target, name);
  let cur = -1;
  const bad: string[] = [];
  for (const e of log) {
    if (e.kind === 'takeover') {
      if (e.token <= cur) bad.push(`takeover at ${e.seq} with token ${e.token}, not above ${cur}`);
      cur = e.token;
    } else if (e.token !== cur) {
      bad.push(`commit at ${e.seq} with token ${e.token} after a takeover with token ${cur}`);
    }
  }
  t.deepEqual(bad, [], `[${target.label}] log audit (${log.length} records): ${log.map((e) => `${e.seq}:${e.kind[0]}${e.token}`).join(' ')}`);
  return log;
}

const takeovers = (log: LogEntry[]): LogEntry[] => log.filter((e) => e.kind === 'takeover');

// ------------------------------------------------------------------ 1. graceful handoff under load

interface Phase { stats: WriterStats; firstOk: number; lastOk: number }

/** runWriter with the times of its first and last acknowledged command. */
async function writerPhase(socket: string, model: BlockModel, o: Omit<WriterOptions, 'exportName' | 'onEvent'>, onEvent?: (e: WriterEvent) => void): Promise<Phase> {
  let firstOk = 0;
  let lastOk = 0;
  const stats = await runWriter(socket, model, {
    ...o,
    exportName: VOL,
    onEvent: (e) => {
      if ((e.type === 'write-done' || e.type === 'flush-done') && e.ok) {
        lastOk = now();
        if (!firstOk) firstOk = lastOk;
      }
      onEvent?.(e);
    },
  });
  return { stats, firstOk, lastOk };
}

async function gracefulHandoff(t: ExecutionContext, target: Target, redis: RedisServer): Promise<void> {
  createVolume(target);
  const [a, b] = await Promise.all([
    host(t, target, 'a', { redis: redis.url }),
    host(t, target, 'b', { redis: redis.url, onHeld: 'wait' }),
  ]);
  const rng = rngFrom(SEED);
  const model = new BlockModel(BLOCKS, (SEED ^ 0x4a4d) >>> 0);
  const wopts = { rng, flushEvery: 4, depth: 4, maxRunBlocks: 16, hotBlocks: 256, bigWriteRate: 0.02 };

  // The handoff is asked for once A has acknowledged a few flushes.
  let flushesOkA = 0;
  let perfT0 = 0;
  let epochT0 = 0;
  // When the request reached Redis, for the timeline in the log.
  let seenAt = 0;
  const poll = setInterval(() => {
    if (!epochT0 || seenAt) return;
    void redis.command('HGET', `baton:lease:{${VOL}}`, 'handoffRequestedBy').then((v) => { if (v && !seenAt) seenAt = Date.now() - epochT0; });
  }, 10);
  t.teardown(() => clearInterval(poll));
  let handoff: Promise<{ r: RunResult; ms: number }> | null = null;
  const phaseA = await writerPhase(a.socket, model, { ...wopts, durationMs: 30_000 }, (e) => {
    if (e.type === 'flush-done' && e.ok && ++flushesOkA === 6 && !handoff) {
      const t0 = now();
      perfT0 = t0;
      epochT0 = Date.now();
      handoff = batonAsync(['handoff', VOL, '--to', 'b', '--redis', redis.url, '--store', target.store], target.env).then((r) => ({ r, ms: now() - t0 }));
    }
  });
  t.truthy(handoff, `A acknowledged only ${flushesOkA} flushes before its writer ended: ${JSON.stringify(phaseA.stats)}\n${tail(a.stderr())}`);
  if (!handoff) return;
  t.is(phaseA.stats.endedBy, 'closed', 'the handoff closed A\'s client connection');
  // Writes after the drain get ESHUTDOWN; nothing else may fail (no EIO: nothing was lost).
  t.deepEqual(Object.keys(phaseA.stats.errnos).filter((e) => Number(e) !== ESHUTDOWN), [], `A's errors: ${JSON.stringify(phaseA.stats.errnos)}`);

  // Every write A REPLIED to must survive a graceful handoff (A flushes before it releases),
  // even those no FLUSH acknowledged: remember them before the model forgets A.
  const repliedOnA = new Map<number, number>();
  for (const s of model.snapshots) for (const [blk, gen] of s.blocks) repliedOnA.set(blk, Math.max(gen, repliedOnA.get(blk) ?? 0));
  for (const [blk, gen] of model.replied) repliedOnA.set(blk, Math.max(gen, repliedOnA.get(blk) ?? 0));
  model.serverLost();
  const firstGenOnB = model.nextGen;

  // The client reattaches on B (B waits for the release: --on-held wait) and goes on.
  let phaseB: Phase | null = null;
  const deadline = now() + 20_000;
  while (!phaseB) {
    try {
      phaseB = await writerPhase(b.socket, model, { ...wopts, durationMs: 1500, finalFlushTries: 5 });
    } catch (err) {
      if (!/GO .* failed/.test(String(err)) || now() > deadline) throw err;
      await sleep(20);
    }
  }
  const { r: hr, ms: handoffMs } = await handoff as { r: RunResult; ms: number };
  // `baton handoff` usually misses B taking the reservation at once and then waits for B to
  // let go (the BUG test at the end of this file); B's writer stops within its --wait, so it
  // still exits 0 here, but the time it prints is not the handoff's.
  t.is(hr.code, 0, hr.output);
  t.regex(hr.stdout, /released for b in \d+ ms/);
  t.is(phaseB.stats.endedBy, 'done', `writer on B: ${JSON.stringify(phaseB.stats)}\n${tail(b.stderr())}`);
  t.is(phaseB.stats.writesFailed + phaseB.stats.flushesFailed, 0, `B's errors: ${JSON.stringify(phaseB.stats.errnos)}`);
  t.true(model.allRepliedCovered, 'B\'s final flush covered everything B acknowledged');
  t.true(logMessages(a).includes('volume handed off'), tail(a.stderr()));

  const stall = phaseB.firstOk - phaseA.lastOk;
  const events = (s: BatonServer, who: string): string[] => s.stderr().split('\n').flatMap((l) => {
    try {
      const o = JSON.parse(l) as { msg?: string; time?: number };
      return o.msg && /handoff|handed|lease|volume|takeover/.test(o.msg) ? [`${who} ${o.time! - epochT0} ms: ${o.msg}`] : [];
    } catch { return []; }
  });
  t.log([`request seen in redis ${seenAt} ms; A last ok ${Math.round(phaseA.lastOk - perfT0)} ms, B first ok ${Math.round(phaseB.firstOk - perfT0)} ms`, ...events(a, 'A'), ...events(b, 'B')].join('\n'));
  t.log(`[${target.label}] A: ${phaseA.stats.writesOk} writes, ${phaseA.stats.flushesOk} flushes ok, errnos ${JSON.stringify(phaseA.stats.errnos)}; ` +
    `\`baton handoff\` took ${Math.round(handoffMs)} ms (${hr.stdout.trim()}); B: ${phaseB.stats.writesOk} writes, ${phaseB.stats.flushesOk} flushes ok`);
  t.log(`[${target.label}] handoff stall (last acknowledged command on A -> first on B): ${Math.round(stall)} ms (target < 1000 ms)${stall < 1000 ? '' : ' MISSED'}`);
  t.true(stall > 0 && stall < 5000, `stall ${Math.round(stall)} ms`);

  // Read everything back through a third host with an empty cache.
  await b.stop();
  t.is(b.proc.exitCode, 0, tail(b.stderr()));
  const c = await host(t, target, 'c', { redis: redis.url });
  const v = await verifyVolume(c.socket, VOL, model);
  t.is(v.problemCount, 0, `[${target.label}] seed ${SEED}: ${describeProblems(v)}`);
  const lost: string[] = [];
  for (const [blk, gen] of repliedOnA) {
    const got = v.observed[blk]!;
    if (got < firstGenOnB && got < gen) lost.push(`block ${blk}: replied generation ${gen}, reads ${got}`);
  }
  t.deepEqual(lost.slice(0, 10), [], `[${target.label}] ${lost.length} writes A replied to were lost in the graceful handoff`);
  t.log(`[${target.label}] verified ${v.blocks} blocks through host c: ${v.atAcked} at the acknowledged generation, ${v.newer} newer; ${repliedOnA.size} blocks A replied to after its last acknowledged flush all survived`);
  const log = await auditLog(t, target);
  t.is(takeovers(log).length, 3, 'takeover records by a, b and c');
}

serialRedis('graceful handoff under a writer: A drains (ESHUTDOWN), flushes and releases; the client goes on on B; nothing lost (file:)', async (t) => {
  const redis = await startRedis(t);
  await gracefulHandoff(t, fileTarget(t), redis);
});

(haveRedis && hasRgw() ? test.serial : test.serial.skip)('graceful handoff under a writer on radosgw', async (t) => {
  const redis = await startRedis(t);
  await gracefulHandoff(t, await rgwTarget(t), redis);
});

// ------------------------------------------------------------------ 2. crash takeover: ext4 + git

const EXT4_TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'mount', 'umount', 'git'];
const isRoot = process.getuid?.() === 0;
const canExt4 = haveRedis && isRoot && EXT4_TOOLS.every(has) && fs.existsSync('/dev/fuse') && fs.existsSync('/dev/loop-control');
if (!canExt4) console.warn(`lease: ext4 crash takeover skipped (root: ${isRoot}, missing: ${EXT4_TOOLS.filter((x) => !has(x)).join(', ') || 'none'})`);
const GIT = ['-c', 'user.name=baton test', '-c', 'user.email=baton@example.invalid', '-c', 'init.defaultBranch=main', '-c', 'safe.directory=*'];

async function hashFiles(root: string, rels: string[]): Promise<Record<string, string>> {
  const out: Record<string, string> = {};
  for (const r of [...rels].sort()) out[r] = await sha256File(path.join(root, r));
  return out;
}

(canExt4 ? test.serial : test.serial.skip)('crash takeover: SIGKILL the host of a mounted ext4 + git repo mid-workload; B (--on-held wait) serves after the TTL; journal replay, git fsck, committed state intact', async (t) => {
  const redis = await startRedis(t);
  const target = fileTarget(t);
  const size = 128 * 1024 * 1024;
  createVolume(target, 'fs', size);
  const [a, b] = await Promise.all([
    host(t, target, 'a', { redis: redis.url }),
    host(t, target, 'b', { redis: redis.url, onHeld: 'wait' }),
  ]);
  const mnt = tempDir(t, 'baton-mnt-');

  // ---- on A: mkfs, a git repo with many files, commit, sync (the committed state is flushed)
  const fuseA = await startNbdfuse(t, a.uri('fs'), tempDir(t, 'baton-fuse-'));
  const loopA = await attachLoop(t, fuseA.file);
  await runOk('mkfs.ext4', ['-q', '-F', '-E', 'lazy_itable_init=0,lazy_journal_init=0', loopA.dev], { timeoutMs: 60_000 });
  const mA = await mountExt4(t, loopA.dev, mnt);
  const expected = new Map<string, string>();
  for (let d = 0; d < 8; d++) {
    await fsp.mkdir(path.join(mnt, 'src', `pkg${d}`), { recursive: true });
    for (let i = 0; i < 25; i++) {
      const rel = path.join('src', `pkg${d}`, `file${i}.txt`);
      const data = randomBytes(100 + ((d * 131 + i * 977) % 20000));
      await fsp.writeFile(path.join(mnt, rel), data);
      expected.set(rel, sha256(data));
    }
  }
  await runOk('git', [...GIT, 'init', '-q', mnt]);
  await runOk('git', [...GIT, '-C', mnt, 'add', '-A'], { timeoutMs: 60_000 });
  await runOk('git', [...GIT, '-C', mnt, 'commit', '-q', '-m', 'committed before the crash'], { timeoutMs: 60_000 });
  const head = (await runOk('git', [...GIT, '-C', mnt, 'rev-parse', 'HEAD'])).stdout.trim();
  await runOk('sync', ['-f', mnt], { timeoutMs: 60_000 });

  // ---- mid-workload: untracked files, some fsync'ed, then SIGKILL A
  let stop = false;
  let written = 0;
  const workload = (async () => {
    await fsp.mkdir(path.join(mnt, 'scratch'), { recursive: true });
    for (let i = 0; !stop; i++) {
      const fh = await fsp.open(path.join(mnt, 'scratch', `f${i}`), 'w');
      try {
        await fh.writeFile(randomBytes(4096 + (i % 7) * 8192));
        if (i % 4 === 0) await fh.sync();
      } finally {
        await fh.close();
      }
      written++;
    }
  })().catch((err: unknown) => String(err));
  while (written < 30) await sleep(10);
  await a.kill();
  const killedAt = now();
  stop = true;

  // ---- B: an attach waits for A's lease to expire, then B recovers and takes over.
  const probe = await BlockClient.attachOk(b.socket, 0, 'fs');
  const servedMs = now() - killedAt;
  t.log(`kill -> B serving: ${Math.round(servedMs)} ms (lease TTL ${TTL_MS} ms; ${written} scratch files written before the kill)`);
  t.true(servedMs < TTL_MS + 5000, `B took ${Math.round(servedMs)} ms`);

  // A's side is dead: take it down (unmount may report I/O errors; that is A's problem now).
  const wl = await Promise.race([workload, sleep(5000).then(() => 'still running')]);
  t.log(`A's workload ended with: ${String(wl ?? 'no error')}`);
  await mA.unmount().catch((err: unknown) => t.log(`unmount on A: ${String(err).split('\n')[0]}`));
  await loopA.detach().catch((err: unknown) => t.log(`losetup -d on A: ${String(err).split('\n')[0]}`));
  await fuseA.unmount();

  // ---- on B: mount (journal replay), the committed state is there, git is sound.
  const fuseB = await startNbdfuse(t, b.uri('fs'), tempDir(t, 'baton-fuse-'));
  const loopB = await attachLoop(t, fuseB.file);
  const mB = await mountExt4(t, loopB.dev, mnt);
  t.deepEqual(await hashFiles(mnt, [...expected.keys()]), Object.fromEntries([...expected.entries()].sort(([x], [y]) => (x < y ? -1 : 1))), 'committed files');
  const fsck = await run('git', [...GIT, '-C', mnt, 'fsck', '--full', '--strict'], { timeoutMs: 60_000 });
  t.is(fsck.code, 0, fsck.output);
  t.is((await runOk('git', [...GIT, '-C', mnt, 'rev-parse', 'HEAD'])).stdout.trim(), head);
  const st = await runOk('git', [...GIT, '-C', mnt, 'status', '--porcelain', '--untracked-files=no']);
  t.is(st.stdout, '', 'tracked files match the commit');
  await mB.unmount();
  const e2 = await run('e2fsck', ['-fn', loopB.dev], { timeoutMs: 60_000 });
  t.is(e2.code, 0, `e2fsck after the takeover: ${e2.output}`);
  await loopB.detach();
  await fuseB.unmount();
  await probe.close();
  await b.stop();
  const log = await auditLog(t, target, 'fs');
  t.is(takeovers(log).length, 2);
});

// ------------------------------------------------------------------ 3. a paused holder (SIGSTOP)

const SALT_A = 0xa;
const SALT_B = 0xb;

async function pausedHolder(t: ExecutionContext, midCommit: boolean): Promise<void> {
  const redis = await startRedis(t);
  const target = fileTarget(t);
  createVolume(target);
  // midCommit: every put on A takes 1.5 s, so A can be stopped while its commit's put is on its
  // way. Nothing cancels that put: when A wakes, it reaches the store (whether A's own lease
  // deadline fenced the volume a moment earlier or not) and finds B's takeover record at its
  // log position; the flush fails and the audit shows no commit of A after the takeover.
  const env = midCommit ? { BATON_FAULTS: JSON.stringify({ latencyMs: { put: 1500 } }) } : {};
  const [a, b] = await Promise.all([
    host(t, target, 'a', { redis: redis.url, env }),
    host(t, target, 'b', { redis: redis.url, onHeld: 'wait' }),
  ]);

  // X: a client of A. Blocks 0..15 at gen 1, flushed; blocks 8..15 at gen 2, not flushed.
  const x = await BlockClient.attachOk(a.socket, SALT_A);
  t.is(await x.write(0, 16, 1), 0);
  t.is(await x.flush(), 0);
  t.is(await x.write(8, 8, 2), 0);
  let pendingFlush: Promise<Result> | null = null;
  if (midCommit) {
    // The flush's commit is past its deadline check and its put is on the way when A stops.
    pendingFlush = x.flush();
    await sleep(300);
  }
  const stoppedAt = now();
  process.kill(a.proc.pid!, 'SIGSTOP');
  t.teardown(() => { try { process.kill(a.proc.pid!, 'SIGCONT'); } catch { /* gone */ } });

  // B acquires once A's lease expired in Redis, commits its takeover, writes 12..19 and flushes.
  const y = await BlockClient.attachOk(b.socket, SALT_B);
  const tookMs = now() - stoppedAt;
  t.log(`A stopped -> B serving: ${Math.round(tookMs)} ms (lease TTL ${TTL_MS} ms)`);
  // B waited for A's lease to expire (renewals run every TTL/3, so normally 2/3 TTL or more;
  // a loose bound, since a loaded machine delays renewals).
  t.true(tookMs > TTL_MS / 3, `B acquired only ${Math.round(tookMs)} ms after A stopped`);
  t.is(await y.write(12, 8, 1), 0);
  t.is(await y.flush(), 0);

  // A wakes up. Its client's next FLUSH (and the one that was in flight) must not succeed.
  process.kill(a.proc.pid!, 'SIGCONT');
  const results: Record<string, Result> = {};
  if (pendingFlush) results['flush in flight across the pause'] = await pendingFlush;
  results['write 20..23 after the pause'] = await x.write(20, 4, 3);
  results['flush after the pause'] = await x.flush();
  t.log(`A's client after SIGCONT: ${JSON.stringify(results)}`);
  for (const [what, r] of Object.entries(results)) {
    if (what.startsWith('flush')) t.not(r, 0, `${what} succeeded on the stale holder`);
  }
  t.true(results['flush after the pause'] === 5 || results['flush after the pause'] === 'closed', `flush after the pause: ${results['flush after the pause']}`);
  await sleep(300);
  const msgs = logMessages(a);
  t.true(msgs.some((m) => /lease lost|volume fenced/.test(m)), tail(a.stderr()));
  t.log(`A said: ${msgs.filter((m) => /lost|fenced|renewal/.test(m)).join(' | ')}`);
  // A new attach on A is refused: b holds the volume.
  const again = await BlockClient.attach(a.socket, SALT_A);
  t.false(again instanceof BlockClient, 'A must not serve the volume again while b holds it');
  if (!(again instanceof BlockClient)) t.regex(again.refused, /served by b/);

  await x.close();
  await y.close();
  await b.stop();
  await a.stop();
  const c = await host(t, target, 'c', { redis: redis.url });
  const got = await readBlocks(c.socket, 0, 24);
  for (let i = 0; i < 8; i++) expectBlock(t, got[i]!, i, SALT_A, 1, 'A flushed it');
  for (let i = 8; i < 12; i++) expectBlock(t, got[i]!, i, SALT_A, 1, 'A\'s later write was never acknowledged by a flush and must not land after the takeover');
  for (let i = 12; i < 20; i++) expectBlock(t, got[i]!, i, SALT_B, 1, 'B flushed it after its takeover');
  for (let i = 20; i < 24; i++) expectBlock(t, got[i]!, i, 0, 0, 'A wrote it after the takeover');
  await auditLog(t, target);
}

serialRedis('paused holder: SIGSTOP A past its TTL, B takes over and writes; A wakes up and its FLUSH fails, nothing it writes lands', async (t) => {
  await pausedHolder(t, false);
});

serialRedis('paused holder mid-commit: A stopped while its commit\'s put is on the way; the put finds B\'s takeover at its log position (store fence)', async (t) => {
  await pausedHolder(t, true);
});

// ------------------------------------------------------------------ 4. a holder partitioned from Redis

/**
 * 'blackhole': packets silently dropped, then delivered late on heal (A's renewals sent during
 * the cut reach Redis after B took over); 'reset': A's connections reset, new ones refused.
 */
async function partitioned(t: ExecutionContext, mode: CutMode): Promise<void> {
  const redis = await startRedis(t);
  const proxy = await startTcpProxy(t, redis.socket);
  const target = fileTarget(t);
  createVolume(target);
  const [a, b] = await Promise.all([
    host(t, target, 'a', { redis: proxy.url }),
    host(t, target, 'b', { redis: redis.url, onHeld: 'wait' }),
  ]);
  const x = await BlockClient.attachOk(a.socket, SALT_A);

  // X writes block i at gen i+1 and flushes, over and over; the cut comes after a few rounds.
  interface Op { block: number; write: Result; flush: Result; sentAt: number; doneAt: number }
  const ops: Op[] = [];
  let cutAt = 0;
  for (let i = 0; i < 400; i++) {
    if (i === 5) { proxy.cut(mode); cutAt = now(); }
    const sentAt = now();
    const w = await x.write(i, 1, i + 1);
    const f = w === 'closed' ? 'closed' : await x.flush();
    ops.push({ block: i, write: w, flush: f, sentAt, doneAt: now() });
    if (f !== 0) break;
    await sleep(40);
  }
  const acked = ops.filter((o) => o.flush === 0);
  const firstFail = ops.find((o) => o.flush !== 0);
  t.truthy(firstFail, 'A never stopped acknowledging flushes');
  if (!firstFail) return;
  const lastAckAfterCut = Math.max(...acked.map((o) => o.doneAt)) - cutAt;
  t.log(`[${mode}] cut -> last acknowledged flush on A: ${Math.round(lastAckAfterCut)} ms; cut -> first refused: ${Math.round(firstFail.doneAt - cutAt)} ms (${JSON.stringify({ write: firstFail.write, flush: firstFail.flush })}); lease TTL ${TTL_MS} ms`);
  // A's last renewal reached Redis before the cut, so its lease there lasts until cut + TTL at
  // the latest: every acknowledgement must come before that, and the refusals start by then.
  t.true(lastAckAfterCut < TTL_MS, `A acknowledged a flush ${Math.round(lastAckAfterCut)} ms after the cut`);
  t.true(firstFail.doneAt - cutAt < TTL_MS, `A still acknowledged ${Math.round(firstFail.doneAt - cutAt)} ms after the cut`);
  t.true(firstFail.flush === 5 || firstFail.flush === 'closed' || firstFail.write === 'closed', JSON.stringify(firstFail));

  // B acquires after A's lease expired and overwrites blocks 0..3 and 200..203.
  const y = await BlockClient.attachOk(b.socket, SALT_B);
  const bAt = now() - cutAt;
  t.true(Math.max(...acked.map((o) => o.doneAt)) - cutAt < bAt, 'every flush A acknowledged came before B served');
  t.log(`[${mode}] cut -> B serving: ${Math.round(bAt)} ms`);
  t.is(await y.write(0, 4, 1000), 0);
  t.is(await y.write(200, 4, 1000), 0);
  t.is(await y.flush(), 0);

  // Heal: A's held bytes (late renewals) reach Redis now. They must change nothing.
  proxy.heal();
  await sleep(TTL_MS / 2);
  const st = await batonAsync(['status', '--redis', redis.url, '--store', target.store, '--json']);
  t.is(st.code, 0, st.output);
  const leases = JSON.parse(st.stdout) as { volume: string; holder: string; token: number }[];
  t.is(leases.length, 1, st.stdout);
  t.is(leases[0]?.holder, 'b', st.stdout);
  // A, reachable again, does not serve the volume: b holds it.
  const again = await BlockClient.attach(a.socket, SALT_A);
  t.false(again instanceof BlockClient, 'A served the volume again while b holds it');
  if (!(again instanceof BlockClient)) t.regex(again.refused, /served by b/);
  // A's old client, if still connected, can land nothing either.
  const late = { write: await x.write(300, 1, 9999), flush: await x.flush() };
  t.not(late.flush, 0, `A acknowledged a flush after healing: ${JSON.stringify(late)}`);

  await x.close();
  await y.close();
  await b.stop();
  await a.stop();
  const c = await host(t, target, 'c', { redis: redis.url });
  const last = ops.length;
  const got = await readBlocks(c.socket, 0, 304);
  for (let i = 0; i < last; i++) {
    const o = ops[i]!;
    if (i < 4) expectBlock(t, got[i]!, i, SALT_B, 1000, 'B overwrote it');
    else if (o.flush === 0) expectBlock(t, got[i]!, i, SALT_A, i + 1, 'A acknowledged its flush');
    else {
      // Refused: it may not have landed (and if A's commit had landed before the takeover, the
      // log audit below would show it in order; here it reads as the fresh volume).
      const g = got[i]!;
      t.true(g.kind === 'zero' || (g.kind === 'block' && g.salt === SALT_A && g.gen === i + 1), `block ${i} (refused on A): ${show(g)}`);
    }
  }
  for (let i = 200; i < 204; i++) expectBlock(t, got[i]!, i, SALT_B, 1000, 'B flushed it');
  expectBlock(t, got[300]!, 300, 0, 0, 'A wrote it after healing');
  const log = await auditLog(t, target);
  t.is(takeovers(log).length, 3);
}

serialRedis('partitioned holder (blackholed TCP to Redis): A stops acknowledging before its lease can expire; B takes over; healed A lands nothing', async (t) => {
  await partitioned(t, 'blackhole');
});

serialRedis('partitioned holder (connections to Redis reset and refused): same guarantees', async (t) => {
  await partitioned(t, 'reset');
});

// ------------------------------------------------------------------ 5. racing acquirers

async function race(t: ExecutionContext, redis: RedisServer | null, hosts: number, rounds: number): Promise<void> {
  const target = fileTarget(t);
  createVolume(target);
  const ids = Array.from({ length: hosts }, (_, i) => `h${i}`);
  const servers = await Promise.all(ids.map((id) => host(t, target, id, { redis: redis?.url ?? null, idleGrace: 0.2 })));
  const winners: string[] = [];
  for (let round = 0; round < rounds; round++) {
    // Everyone through the greeting first, then every GO at once.
    const clients = await Promise.all(servers.map(async (s) => {
      const c = await RawClient.connect(s.socket);
      await c.greeting();
      await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
      return c;
    }));
    const results = await Promise.all(clients.map((c) => c.go(VOL).then(() => 'ok', (err: unknown) => (err instanceof Error ? err.message : String(err)))));
    const won = results.flatMap((r, i) => (r === 'ok' ? [ids[i]!] : []));
    t.is(won.length, 1, `round ${round}: exactly one host serves; results: ${JSON.stringify(results)}`);
    const w = won[0];
    if (w) {
      winners.push(w);
      for (const [i, r] of results.entries()) {
        if (r !== 'ok') t.regex(r, new RegExp(`served by ${w} `), `${ids[i]} refused naming the holder`);
      }
      const statusArgs = ['status', '--store', target.store, '--json', ...(redis ? ['--redis', redis.url] : [])];
      const st = await batonAsync(statusArgs);
      t.is(st.code, 0, st.output);
      const leases = JSON.parse(st.stdout) as { volume: string; holder: string; token: number }[];
      t.deepEqual(leases.map((l) => [l.volume, l.holder]), [[VOL, w]], st.stdout);
      // The winner writes and flushes, so the log shows its takeover and its commit.
      const wc = new BlockClient(clients[ids.indexOf(w)]!, 0x5ace);
      t.is(await wc.write(round, 1, round + 1), 0);
      t.is(await wc.flush(), 0);
    }
    for (const c of clients) { await c.disconnect().catch(() => {}); c.destroy(); }
    // Wait for the winner's idle close to release the lease.
    const deadline = now() + 10_000;
    for (;;) {
      const st = await batonAsync(['status', '--store', target.store, '--json', ...(redis ? ['--redis', redis.url] : [])]);
      if (st.code === 0 && (JSON.parse(st.stdout) as unknown[]).length === 0) break;
      if (now() > deadline) { t.fail(`the lease was not released: ${st.stdout}`); return; }
      await sleep(100);
    }
  }
  t.log(`${redis ? 'redis' : 'embedded'}: ${hosts} hosts, ${rounds} rounds, winners ${winners.join(', ')}`);
  const log = await auditLog(t, target);
  t.is(takeovers(log).length, rounds, 'one takeover record per round');
}

serialRedis('racing acquirers (Redis): 8 hosts attach the same volume at once; exactly one serves, the others name it', async (t) => {
  const redis = await startRedis(t);
  await race(t, redis, 8, 3);
});

test.serial('racing acquirers (embedded lease files): 8 processes on one store; exactly one serves', async (t) => {
  await race(t, null, 8, 2);
});

// ------------------------------------------------------------------ 6. Redis loses the lease

async function redisLoses(t: ExecutionContext, how: 'flushall' | 'restart'): Promise<void> {
  const redis = await startRedis(t);
  const target = fileTarget(t);
  createVolume(target);
  const [a, b] = await Promise.all([
    host(t, target, 'a', { redis: redis.url }),
    host(t, target, 'b', { redis: redis.url }),
  ]);
  const rng = rngFrom(SEED ^ 0x66);
  const model = new BlockModel(BLOCKS, (SEED ^ 0x6b6c) >>> 0);
  const wopts = { rng, flushEvery: 3, depth: 4, maxRunBlocks: 16, hotBlocks: 256 };

  let flushesOk = 0;
  let bServing = 0;
  let ackedAfterB = 0;
  let stopA = false;
  let fire: () => void = () => {};
  const fired = new Promise<void>((resolve) => { fire = resolve; });
  const phaseA = writerPhase(a.socket, model, { ...wopts, durationMs: 30_000, stopWhen: () => stopA }, (e) => {
    if (e.type !== 'flush-done' || !e.ok) return;
    if (bServing) ackedAfterB++;
    if (++flushesOk === 5) fire();
  });
  const ended = await Promise.race([fired.then(() => false), phaseA.then(() => true)]);
  if (ended) { t.fail(`A's writer ended before 5 flushes: ${JSON.stringify((await phaseA).stats)}\n${tail(a.stderr())}`); return; }

  // Redis loses everything while A holds the volume and writes; B attaches right away.
  const lostAt = now();
  if (how === 'flushall') await redis.flushAll();
  else await redis.restart();
  let br: BlockClient | { refused: string } = { refused: 'never tried' };
  const refusals: string[] = [];
  while (now() - lostAt < 10_000) {
    br = await BlockClient.attach(b.socket, 0);
    if (br instanceof BlockClient) break;
    refusals.push(br.refused);
    await sleep(50);
  }
  bServing = now();
  // Give A time to (wrongly) go on, then stop its writer if it still runs.
  const stopTimer = setTimeout(() => { stopA = true; }, 3000);
  const pa = await phaseA;
  clearTimeout(stopTimer);
  t.true(br instanceof BlockClient, `B's attach after Redis lost the lease: ${br instanceof BlockClient ? 'ok' : br.refused}\n${tail(b.stderr())}`);
  t.log(`${how}: Redis lost the lease -> B serving ${Math.round(bServing - lostAt)} ms${refusals.length ? ` (after ${refusals.length} refusals: ${refusals[0]})` : ''}`);
  t.log(`${how}: A: ${pa.stats.writesOk} writes, ${pa.stats.flushesOk} flushes ok, errnos ${JSON.stringify(pa.stats.errnos)}, ended ${pa.stats.endedBy}; flushes A acknowledged after B served: ${ackedAfterB}`);
  const fenceReasons = a.stderr().split('\n').flatMap((l) => { try { const o = JSON.parse(l) as { msg?: string; reason?: string }; return o.msg && /lost|fenced/.test(o.msg) ? [`${o.msg}: ${o.reason ?? ''}`] : []; } catch { return []; } });
  t.log(`A said: ${fenceReasons.join(' | ')}`);
  t.log(`B said: ${logMessages(b).filter((m) => /token|takeover/.test(m)).join(' | ')}`);
  // Redis forgot the token counter: B's first token repeated A's, the log refused it, B took a higher one.
  t.true(logMessages(b).includes('lease token not above the log; re-acquiring'), tail(b.stderr()));

  // B holds and has not written: it shows the log as of its takeover. Every flush A
  // acknowledged must be in it (one that landed after B's takeover would be missing here).
  model.serverLost();
  const v1 = await verifyVolume(b.socket, VOL, model);
  t.is(v1.problemCount, 0, `[${how}] seed ${SEED}, read through B after the takeover: ${describeProblems(v1)}`);
  model.rebase(v1.observed);

  // B writes on; a fresh host reads it all back.
  const pb = await writerPhase(b.socket, model, { ...wopts, durationMs: 1000, finalFlushTries: 5 });
  t.is(pb.stats.flushesFailed, 0, JSON.stringify(pb.stats));
  t.true(model.allRepliedCovered);
  if (br instanceof BlockClient) await br.close();
  await b.stop();
  await a.stop();
  const c = await host(t, target, 'c', { redis: redis.url });
  const v2 = await verifyVolume(c.socket, VOL, model);
  t.is(v2.problemCount, 0, `[${how}] seed ${SEED}, final read through c: ${describeProblems(v2)}`);
  const log = await auditLog(t, target);
  t.log(`log: ${log.filter((e) => e.kind === 'takeover').map((e) => `takeover ${e.token} at ${e.seq}`).join(', ')}; ${log.length} records`);
}

serialRedis('Redis FLUSHALL while A holds and writes: B gets a lease (repeated token, re-acquired higher); no two writers land, no acknowledged flush lost', async (t) => {
  await redisLoses(t, 'flushall');
});

serialRedis('Redis restart (data lost) while A holds and writes: same guarantees', async (t) => {
  await redisLoses(t, 'restart');
});

// ------------------------------------------------------------------ 7. the embedded lease

test.serial('embedded lease (no --redis): a second server on the same file: store refuses the volume while the first holds it; free at once when the holder dies', async (t) => {
  const target = fileTarget(t);
  createVolume(target);
  const [a, b] = await Promise.all([
    host(t, target, 'a', { redis: null }),
    host(t, target, 'b', { redis: null }),
  ]);
  const x = await BlockClient.attachOk(a.socket, SALT_A);
  t.is(await x.write(0, 4, 1), 0);
  t.is(await x.flush(), 0);
  const refused = await BlockClient.attach(b.socket, SALT_B);
  t.false(refused instanceof BlockClient, 'B served a volume A holds');
  if (!(refused instanceof BlockClient)) t.regex(refused.refused, /volume w is served by a .*baton handoff w --to b/);

  // A's client leaves; after A's idle grace the lease is free and B serves.
  await x.close();
  let y: BlockClient | null = null;
  const t0 = now();
  while (!y && now() - t0 < 10_000) {
    const r = await BlockClient.attach(b.socket, SALT_B);
    if (r instanceof BlockClient) y = r;
    else await sleep(50);
  }
  t.truthy(y, 'B never got the volume after A let it go');
  if (!y) return;
  t.log(`A idle -> B serving: ${Math.round(now() - t0)} ms (idle grace 500 ms)`);
  t.is(await y.write(4, 4, 1), 0);
  t.is(await y.flush(), 0);

  // B crashes: its lease file names a dead pid on this machine, so A may take over at once.
  await b.kill();
  const t1 = now();
  const x2 = await BlockClient.attachOk(a.socket, SALT_A);
  t.log(`SIGKILL B -> A serving: ${Math.round(now() - t1)} ms (no TTL wait: the holder's pid is dead)`);
  t.true(now() - t1 < TTL_MS, 'a dead local holder must not cost a TTL');
  const got = await readBlocks(a.socket, 0, 8);
  for (let i = 0; i < 4; i++) expectBlock(t, got[i]!, i, SALT_A, 1, 'A flushed it');
  for (let i = 4; i < 8; i++) expectBlock(t, got[i]!, i, SALT_B, 1, 'B flushed it');
  await x2.close();
  await auditLog(t, target);
});

// ------------------------------------------------------------------ fixed bugs (their reproductions)

/**
 * BUG in `baton handoff` (cli/baton.ts, the wait loop after requestHandoff): it waits until
 * the lease is gone or `reservedFor === --to`, but a target that is already waiting for the
 * volume (a client attached to it with --on-held wait, or --on-held takeover) acquires the
 * reservation within a millisecond or two of the release. The key then says `holder: b`,
 * which the loop does not recognise: the command keeps polling until b lets the volume go,
 * and if b keeps it longer than --wait, exits 1 with "b did not release w within N s"
 * although the handoff succeeded (and when it does return, "released for b in N ms" counts
 * b's whole session). Fix: also stop when `l.holder === opts.to`.
 * Repro: A holds w; a client waits on B (--on-held wait); `baton handoff w --to b --wait 2`
 * -> exit 1, "b did not release w within 3 s", while B serves w. Three handoffs back and
 * forth here; each may catch the reservation window by luck (a few ms out of 20 ms polls), all
 * three do so very rarely.
 */
(haveRedis ? test.serial : test.serial.skip)('fixed BUG: `baton handoff` no longer reports a timeout when the target host takes the volume at once', async (t) => {
  const redis = await startRedis(t);
  const target = fileTarget(t);
  createVolume(target);
  const hosts: Record<string, BatonServer> = {};
  for (const id of ['a', 'b']) hosts[id] = await host(t, target, id, { redis: redis.url, onHeld: 'wait' });
  let holder = await BlockClient.attachOk(hosts.a!.socket, SALT_A);
  const outcomes: string[] = [];
  for (const [from, to] of [['a', 'b'], ['b', 'a'], ['a', 'b']] as const) {
    // A client is already waiting on the target, as after a reconnect.
    const waiting = BlockClient.attach(hosts[to]!.socket, SALT_B);
    await sleep(300);
    const r = await batonAsync(['handoff', VOL, '--to', to, '--wait', '2', '--redis', redis.url, '--store', target.store]);
    const next = await waiting;
    t.true(next instanceof BlockClient, `${to} serves after the handoff`);
    outcomes.push(`${from}->${to}: exit ${r.code} ${(r.stdout + r.stderr).trim()}`);
    await holder.close();
    if (!(next instanceof BlockClient)) return;
    holder = next;
  }
  await holder.close();
  t.log(outcomes.join('\n'));
  for (const o of outcomes) t.regex(o, /exit 0 volume w released for/, o);
});

/**
 * BUG in LocalDirObjectStore.delete (src/store/local-dir.ts): after unlinking the object it
 * fsyncs the parent directory; if another process (or store instance) emptied and removed
 * that directory in between (its own delete climbing up with rmdir), the open() for the fsync
 * fails with ENOENT and the delete throws an IoError, although the object is gone. Seen for
 * real: two `baton serve` started at once on one file: store, one exits at startup with
 * "delete _probe/...: ENOENT: no such file or directory, open 'STORE/_probe'" (the create-only
 * probe of each server puts and deletes a key under _probe/). Fix: treat ENOENT (and
 * ENOTDIR) from that fsyncDir as done. Repro: two LocalDirObjectStore on one directory, each
 * looping put + delete of its own keys under one prefix; within ~50 rounds one delete throws.
 */
test.serial('fixed BUG: file: store: concurrent put+delete under one prefix from two stores (two servers starting at once) fails with ENOENT', async (t) => {
  const { LocalDirObjectStore } = await import('../../src/store/local-dir.js');
  const root = tempDir(t, 'baton-store-race-');
  const stores = [new LocalDirObjectStore(root), new LocalDirObjectStore(root)];
  const errors: string[] = [];
  await Promise.all(stores.map(async (s, n) => {
    for (let i = 0; i < 400 && errors.length === 0; i++) {
      const key = `_probe/${n}-${i}`;
      try {
        await s.put(key, Buffer.from('probe'), { ifNoneMatch: true });
        await s.delete(key);
      } catch (err) {
        errors.push(`${key}: ${String(err)}`);
      }
    }
  }));
  t.deepEqual(errors, []);
});
