/**
 * The single-writer lease, one table of cases run against both managers: RedisLeaseManager
 * against a real redis-server this file starts (on a Unix socket, one per test, so tests that
 * FLUSHALL or kill it stay isolated; skipped when redis-server is not installed), and
 * LocalLeaseManager on a temp directory. Short TTLs keep the file well under 40 s: 1 s where
 * expiry is the point, 2-3 s elsewhere, so that a loaded machine (event-loop stalls of a few
 * hundred ms) does not make a healthy holder miss its deadline.
 */
import test, { type ExecutionContext } from 'ava';
import { spawn, spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { performance } from 'node:perf_hooks';
import { Redis } from 'ioredis';
import { InvalidArgumentError, LeaseHeldError, LeaseLostError, StoreUnavailableError } from '../../src/errors.js';
import type { Lease, LeaseManager, LeaseStatus } from '../../src/lease/lease.js';
import { LocalLeaseManager } from '../../src/lease/local.js';
import { leaseMargin, type RenewingLease } from '../../src/lease/renewing.js';
import { RedisLeaseManager, openRedisLeaseManager, parseRedisUrl, redact } from '../../src/lease/redis.js';

const HAS_REDIS = spawnSync('redis-server', ['--version'], { stdio: 'ignore' }).status === 0;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

async function until(cond: () => boolean | Promise<boolean>, timeoutMs: number, stepMs = 5): Promise<boolean> {
  const end = performance.now() + timeoutMs;
  while (performance.now() < end) {
    if (await cond()) return true;
    await sleep(stepMs);
  }
  return cond();
}

async function tempDir(t: ExecutionContext, prefix: string): Promise<string> {
  const dir = await fsp.mkdtemp(path.join(os.tmpdir(), prefix));
  t.teardown(() => fsp.rm(dir, { recursive: true, force: true }));
  return dir;
}

/** The process is gone, or a zombie nobody reaps (a daemon's parent may be a PID 1 that does not). */
function gone(pid: number): boolean {
  try { process.kill(pid, 0); } catch { return true; }
  try { return /^\d+ \(.*\) Z/.test(fs.readFileSync(`/proc/${pid}/stat`, 'utf8')); } catch { return false; }
}

interface RedisServer { url: string; sock: string; stop(): Promise<void> }

/** A private redis-server on a Unix socket (`--port 0`: no TCP, so nothing collides). */
async function startRedis(t: ExecutionContext): Promise<RedisServer> {
  const dir = await tempDir(t, 'baton-redis-');
  const sock = path.join(dir, 'redis.sock');
  const pidfile = path.join(dir, 'redis.pid');
  const r = spawnSync('redis-server', ['--port', '0', '--unixsocket', sock, '--save', '', '--appendonly', 'no', '--daemonize', 'yes', '--pidfile', pidfile, '--dir', dir], { encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`redis-server failed: ${r.stderr}${r.stdout}`);
  if (!(await until(() => fs.existsSync(sock) && fs.existsSync(pidfile), 5000))) throw new Error('redis-server did not create its socket');
  const stop = async (): Promise<void> => {
    let pid: number;
    try { pid = Number.parseInt(await fsp.readFile(pidfile, 'utf8'), 10); } catch { return; }
    try { process.kill(pid, 'SIGKILL'); } catch { return; }
    await until(() => gone(pid), 3000);
  };
  t.teardown(stop);
  return { url: `unix://${sock}`, sock, stop };
}

interface MakeOpts { ttlMs?: number; renew?: boolean }

interface Env {
  kind: 'redis' | 'local';
  make(o?: MakeOpts): Promise<LeaseManager>;
  /** Lose all lease data (Redis FLUSHALL; local: empty the directory). */
  wipe(): Promise<void>;
  server?: RedisServer;
}

async function makeEnv(t: ExecutionContext, kind: 'redis' | 'local'): Promise<Env> {
  if (kind === 'redis') {
    const server = await startRedis(t);
    return {
      kind,
      server,
      async make(o = {}) {
        const m = await openRedisLeaseManager(server.url, { ttlMs: o.ttlMs ?? 3000, ...(o.renew === false ? { renew: false } : {}) });
        t.teardown(() => m.close());
        return m;
      },
      async wipe() {
        const r = new Redis({ path: server.sock, lazyConnect: true });
        await r.connect();
        await r.flushall();
        r.disconnect();
      },
    };
  }
  const dir = await tempDir(t, 'baton-lease-');
  return {
    kind,
    async make(o = {}) {
      const m = new LocalLeaseManager(dir, { ttlMs: o.ttlMs ?? 3000, ...(o.renew === false ? { renew: false } : {}) });
      t.teardown(() => m.close());
      return m;
    },
    async wipe() {
      for (const f of await fsp.readdir(dir)) await fsp.rm(path.join(dir, f), { force: true });
    },
  };
}

/** Register the case for both managers (Redis skipped cleanly without redis-server). */
function both(title: string, fn: (t: ExecutionContext, e: Env) => Promise<void>): void {
  for (const kind of ['redis', 'local'] as const) {
    const reg = kind === 'redis' && !HAS_REDIS ? test.skip : test;
    reg(`${kind}: ${title}`, async (t) => fn(t, await makeEnv(t, kind)));
  }
}

function redisOnly(title: string, fn: (t: ExecutionContext, e: Env) => Promise<void>): void {
  (HAS_REDIS ? test : test.skip)(`redis: ${title}`, async (t) => fn(t, await makeEnv(t, 'redis')));
}

const renewNow = (l: Lease): Promise<boolean> => (l as RenewingLease).renewNow();

// ------------------------------------------------------------------ the table

both('acquire, renew past the TTL, release', async (t, e) => {
  const m = await e.make({ ttlMs: 2000 });
  const l = await m.acquire('v', 'hostA');
  t.is(l.volume, 'v');
  t.is(l.holder, 'hostA');
  t.true(l.token >= 1);
  let lost = '';
  l.onLost((r) => { lost = r; });
  const rec = await m.inspect('v');
  t.like(rec, { volume: 'v', holder: 'hostA', token: l.token });
  t.true(rec!.ttlMs > 0 && rec!.ttlMs <= 2000);
  await sleep(2600); // longer than the TTL: only renewals keep it
  t.is(lost, '');
  t.true(l.validUntil() > performance.now());
  t.like(await m.inspect('v'), { holder: 'hostA', token: l.token });
  await l.release();
  t.is(l.validUntil(), -Infinity);
  t.is(await m.inspect('v'), null);
  await l.release(); // twice is harmless
  const l2 = await m.acquire('v', 'hostA');
  t.true(l2.token > l.token);
  await l2.release();
  t.is(lost, '', 'a release is not a loss');
});

both('a second acquire fails with LeaseHeldError naming the holder', async (t, e) => {
  const a = await e.make();
  const b = await e.make();
  const l = await a.acquire('v', 'hostA');
  const err = await t.throwsAsync(b.acquire('v', 'hostB'), { instanceOf: LeaseHeldError });
  t.regex(err!.message, new RegExp(`volume v is served by hostA \\(token ${l.token}, lease expires in [0-9.]+ s\\); attach there, or hand it over: baton handoff v --to hostB`));
  // Same host id from another process: still held (both would write).
  const same = await t.throwsAsync(b.acquire('v', 'hostA'), { instanceOf: LeaseHeldError });
  t.regex(same!.message, /already served under this host id hostA/);
  // waitMs waits, then gives up with the same error.
  const t0 = performance.now();
  await t.throwsAsync(b.acquire('v', 'hostB', { waitMs: 300 }), { instanceOf: LeaseHeldError, message: /served by hostA/ });
  t.true(performance.now() - t0 >= 290);
  // waitMs succeeds once the holder releases.
  setTimeout(() => void l.release(), 200);
  const lb = await b.acquire('v', 'hostB', { waitMs: 3000 });
  t.true(lb.token > l.token);
  await t.throwsAsync(a.acquire('bad/name', 'hostA'), { instanceOf: InvalidArgumentError });
  await t.throwsAsync(a.acquire('v2', ''), { instanceOf: InvalidArgumentError });
});

both('tokens strictly increase across acquisitions, releases, handoffs and expiries', async (t, e) => {
  const a = await e.make();
  const b = await e.make();
  const hung = await e.make({ ttlMs: 1000, renew: false });
  const tokens: number[] = [];
  let l = await a.acquire('v', 'hostA'); tokens.push(l.token);
  await l.release();
  l = await b.acquire('v', 'hostB'); tokens.push(l.token);
  await l.release('hostA');
  l = await a.acquire('v', 'hostA'); tokens.push(l.token);
  await l.release();
  l = await hung.acquire('v', 'hostH'); tokens.push(l.token); // never renewed: expires
  l = await b.acquire('v', 'hostB', { waitMs: 5000 }); tokens.push(l.token);
  await l.release();
  for (let i = 1; i < tokens.length; i++) t.true(tokens[i]! > tokens[i - 1]!, `tokens ${tokens.join(' ')}`);
});

both('a holder that stops renewing loses the lease (onLost) before another host acquires', async (t, e) => {
  const ttl = 1000;
  const hung = await e.make({ ttlMs: ttl, renew: false });
  const b = await e.make({ ttlMs: 3000 });
  const l = await hung.acquire('v', 'hostA');
  let lostAt = 0;
  let reason = '';
  l.onLost((r) => { lostAt = performance.now(); reason = r; });
  const lb = await b.acquire('v', 'hostB', { waitMs: 5000 });
  // B's acquire started no earlier than this (validUntil = start of its last renewal or of
  // the acquire + ttl - margin).
  const bStarted = lb.validUntil() - (3000 - leaseMargin(3000));
  t.true(lostAt > 0, 'onLost fired');
  t.true(lostAt < bStarted, `lost at ${lostAt.toFixed(0)}, B started at ${bStarted.toFixed(0)}`);
  t.regex(reason, /could not renew the lease/);
  t.true(l.validUntil() < performance.now());
  t.true(lb.token > l.token);
  // The old holder can no longer hand the volume over.
  await t.throwsAsync(l.release('hostC'), { instanceOf: LeaseLostError });
  t.like(await b.inspect('v'), { holder: 'hostB', token: lb.token });
});

both('a lease lost at its own deadline (a late renewal) is freed in the store by release(): the next acquire does not wait for the expiry', async (t, e) => {
  // renew: false is a holder whose renewals all come too late (a stalled event loop): it
  // gives the lease up at validUntil, while the store keeps the record one margin longer.
  const ttl = 3000;
  const stalled = await e.make({ ttlMs: ttl, renew: false });
  const other = await e.make({ ttlMs: ttl });
  const l = await stalled.acquire('v', 'hostA');
  let lost = false;
  l.onLost(() => { lost = true; });
  t.true(await until(() => lost, ttl + 1000), 'lost at its deadline');
  const rec = await other.inspect('v');
  t.like(rec, { holder: 'hostA', token: l.token }, 'the store still has it (its expiry is a margin later)');
  await l.release();
  t.is(await other.inspect('v'), null, 'released in the store');
  const again = await stalled.acquire('v', 'hostA'); // no waitMs: refused if it were still held
  t.true(again.token > l.token);
  await again.release();
});

both('release(to) reserves the volume: that host acquires at once, nobody else', async (t, e) => {
  const a = await e.make();
  const b = await e.make({ ttlMs: 1000 }); // its reservation below lasts one (short) TTL
  const c = await e.make();
  const la = await a.acquire('v', 'hostA');
  await la.release('hostB');
  t.like(await c.inspect('v'), { holder: '', reservedFor: 'hostB', token: la.token });
  const ec = await t.throwsAsync(c.acquire('v', 'hostC'), { instanceOf: LeaseHeldError });
  t.regex(ec!.message, /handed over to hostB and is reserved for it/);
  const t0 = performance.now();
  const lb = await b.acquire('v', 'hostB');
  t.true(performance.now() - t0 < 500, 'at once, not after an expiry');
  t.true(lb.token > la.token);
  await t.throwsAsync(c.acquire('v', 'hostC'), { instanceOf: LeaseHeldError, message: /served by hostB/ });
  // A reservation nobody claims expires after one TTL.
  await lb.release('hostX');
  await t.throwsAsync(c.acquire('v', 'hostC'), { instanceOf: LeaseHeldError, message: /reserved/ });
  const lc = await c.acquire('v', 'hostC', { waitMs: 5000 });
  t.true(lc.token > lb.token);
});

both('requestHandoff reaches the holder within 200 ms, once per request', async (t, e) => {
  // TTL 3 s: the first renewal comes 1 s after the acquire, so a notice within 200 ms can
  // only come from the fast path (Redis pub/sub; fs.watch for lease files).
  const a = await e.make({ ttlMs: 3000 });
  const b = await e.make({ ttlMs: 3000 });
  const la = await a.acquire('v', 'hostA');
  const seen: { to: string; ms: number }[] = [];
  const t0 = performance.now();
  la.onHandoffRequest((to) => seen.push({ to, ms: performance.now() - t0 }));
  await b.requestHandoff('v', 'hostB');
  t.true(await until(() => seen.length > 0, 1000), 'handoff request noticed');
  t.is(seen[0]!.to, 'hostB');
  // Redis: pub/sub, ~200 ms budget. Lease files: fs.watch, bounded well below the first
  // renewal (+1 s) so it still proves the fast path on a loaded machine.
  const budget = e.kind === 'redis' ? 200 : 600;
  t.true(seen[0]!.ms < budget, `noticed after ${seen[0]!.ms.toFixed(0)} ms (budget ${budget})`);
  t.like(await b.inspect('v'), { holder: 'hostA', handoffRequestedBy: 'hostB' });
  await sleep(1200); // a renewal sees the same request: no second callback
  t.is(seen.length, 1);
  // A late subscriber still hears of the pending request.
  let late = '';
  la.onHandoffRequest((to) => { late = to; });
  await sleep(0);
  t.is(late, 'hostB');
  await t.throwsAsync(b.requestHandoff('v', 'hostA'), { instanceOf: InvalidArgumentError, message: /hostA already serves v/ });
  await t.throwsAsync(b.requestHandoff('free', 'hostB'), { instanceOf: InvalidArgumentError, message: 'nobody holds free; just attach on hostB' });
  await la.release('hostB');
  const lb = await b.acquire('v', 'hostB');
  t.true(lb.token > la.token);
  t.is(await b.inspect('v').then((r) => r?.handoffRequestedBy), undefined, 'a new holder starts without a pending request');
});

both('20 racing acquirers on separate connections: exactly one wins', async (t, e) => {
  const managers = await Promise.all(Array.from({ length: 20 }, () => e.make()));
  const results = await Promise.allSettled(managers.map((m, i) => m.acquire('race', `host${i}`)));
  const won = results.filter((r): r is PromiseFulfilledResult<Lease> => r.status === 'fulfilled');
  t.is(won.length, 1);
  for (const r of results) if (r.status === 'rejected') t.true(r.reason instanceof LeaseHeldError, String(r.reason));
  t.like(await managers[0]!.inspect('race'), { holder: won[0]!.value.holder, token: won[0]!.value.token });
});

both('minToken above the counter (the lease store lost its data) gives a higher token', async (t, e) => {
  const m = await e.make();
  let l = await m.acquire('v', 'hostA');
  await l.release();
  l = await m.acquire('v', 'hostA');
  const old = l.token;
  await l.release();
  await e.wipe(); // FLUSHALL / empty directory: the counter is gone
  l = await m.acquire('v', 'hostA', { minToken: old });
  t.true(l.token > old, `${l.token} > ${old}`);
  await l.release();
  const after = await m.acquire('v', 'hostA');
  t.true(after.token > l.token, 'the counter was raised to the new token');
  await after.release();
  // minToken below the counter changes nothing.
  const low = await m.acquire('v', 'hostA', { minToken: 1 });
  t.is(low.token, after.token + 1);
  await low.release();
  // Why minToken matters: without it, a wiped store starts over.
  await e.wipe();
  const fresh = await m.acquire('v', 'hostA');
  t.true(fresh.token <= old);
});

both('validUntil is in the future after acquire and within the TTL', async (t, e) => {
  const ttl = 3000;
  const m = await e.make({ ttlMs: ttl });
  const before = performance.now();
  const l = await m.acquire('v', 'hostA');
  const now = performance.now();
  t.true(l.validUntil() > now);
  t.true(l.validUntil() <= now + ttl - leaseMargin(ttl));
  t.true(l.validUntil() >= before + ttl - leaseMargin(ttl));
  const v0 = l.validUntil();
  t.true(await renewNow(l));
  t.true(l.validUntil() > v0, 'a renewal extends it');
  await l.release();
  t.true(l.validUntil() < performance.now());
});

both('status round-trips through inspect and list', async (t, e) => {
  const m = await e.make();
  const l1 = await m.acquire('s1', 'hostA');
  const l2 = await m.acquire('s2', 'hostA');
  const st: LeaseStatus = { dirtyBytes: 12345, lastFlushAt: '2026-11-29T17:00:00.000Z', lastCommitSeq: 42, address: '10.0.0.1:10809' };
  l1.setStatus(st);
  t.true(await renewNow(l1));
  t.deepEqual((await m.inspect('s1'))?.status, st);
  t.is((await m.inspect('s2'))?.status, undefined);
  let all = (await m.list()).filter((r) => r.volume === 's1' || r.volume === 's2');
  t.deepEqual(all.map((r) => [r.volume, r.holder, r.token]), [['s1', 'hostA', l1.token], ['s2', 'hostA', l2.token]]);
  t.deepEqual(all[0]!.status, st);
  // A reservation shows as holder '' with reservedFor, and keeps the last status.
  await l1.release('hostB');
  await l2.release();
  all = await m.list();
  t.deepEqual(all.map((r) => [r.volume, r.holder, r.reservedFor]), [['s1', '', 'hostB']]);
  t.deepEqual(all[0]!.status, st);
});

// ------------------------------------------------------------------ Redis only

redisOnly('Redis down: connecting and acquiring fail fast with a clear message', async (t, e) => {
  let t0 = performance.now();
  const err = await t.throwsAsync(openRedisLeaseManager('unix:///nonexistent/baton/redis.sock'), { instanceOf: StoreUnavailableError });
  t.regex(err!.message, /^cannot reach Redis at unix:\/\/\/nonexistent\/baton\/redis\.sock: start it or fix --redis/);
  t.true(performance.now() - t0 < 1000);
  const m = await e.make({ ttlMs: 2000 });
  const l = await m.acquire('v', 'hostA');
  let lostAt = 0;
  l.onLost(() => { lostAt = performance.now(); });
  await e.server!.stop();
  const deadline = l.validUntil(); // no renewal can succeed from here on
  t0 = performance.now();
  const down = await t.throwsAsync(m.acquire('w', 'hostA'), { instanceOf: StoreUnavailableError });
  t.regex(down!.message, /cannot reach Redis at unix:.*redis\.sock: start it or fix --redis/);
  await t.throwsAsync(m.inspect('v'), { instanceOf: StoreUnavailableError });
  t.true(performance.now() - t0 < 500, 'no hang');
  // The holder cannot renew: it gives the lease up at its deadline.
  t.true(await until(() => lostAt > 0, 3000), 'onLost fired');
  t.true(lostAt >= deadline && lostAt < deadline + 500, `lost ${(lostAt - deadline).toFixed(0)} ms after the deadline`);
  t.is(l.validUntil(), -Infinity);
});

redisOnly('a frozen Redis (SIGSTOP): commands time out instead of hanging; the holder gives up at its deadline', async (t, e) => {
  const m = await e.make({ ttlMs: 2000 }); // command timeout ttl/3 = 666 ms
  const l = await m.acquire('v', 'hostA');
  let lostAt = 0;
  l.onLost(() => { lostAt = performance.now(); });
  const pid = Number.parseInt(await fsp.readFile(path.join(path.dirname(e.server!.sock), 'redis.pid'), 'utf8'), 10);
  process.kill(pid, 'SIGSTOP');
  t.teardown(() => { try { process.kill(pid, 'SIGCONT'); } catch { /* gone */ } });
  const deadline = l.validUntil();
  const t0 = performance.now();
  const err = await t.throwsAsync(m.acquire('w', 'hostA'), { instanceOf: StoreUnavailableError });
  t.regex(err!.message, /did not answer within 666 ms/);
  t.true(performance.now() - t0 < 2000, `failed after ${(performance.now() - t0).toFixed(0)} ms`);
  t.true(await until(() => lostAt > 0, 3000), 'onLost fired');
  t.true(lostAt >= deadline && lostAt < deadline + 500);
});

redisOnly('a holder whose connection is gone loses the lease before another host acquires', async (t, e) => {
  const a = (await e.make({ ttlMs: 1000 })) as RedisLeaseManager;
  const b = await e.make();
  const l = await a.acquire('v', 'hostA');
  let lostAt = 0;
  l.onLost(() => { lostAt = performance.now(); });
  a.client.disconnect(); // renewals now fail at once (no offline queue)
  const lb = await b.acquire('v', 'hostB', { waitMs: 5000 });
  const bStarted = lb.validUntil() - (3000 - leaseMargin(3000));
  t.true(lostAt > 0 && lostAt < bStarted, `lost at ${lostAt.toFixed(0)}, B started at ${bStarted.toFixed(0)}`);
  t.true(lb.token > l.token);
});

redisOnly('a renewal that finds another token loses the lease at once', async (t, e) => {
  const m = await e.make();
  const l = await m.acquire('v', 'hostA');
  let reason = '';
  l.onLost((r) => { reason = r; });
  await e.wipe();
  const other = await e.make();
  const lo = await other.acquire('v', 'hostB');
  t.false(await renewNow(l));
  t.regex(reason, new RegExp(`hostB holds it now \\(token ${lo.token}\\)`));
  t.true(l.validUntil() < performance.now());
  // Its release must not touch the new holder's lease.
  await l.release();
  t.like(await other.inspect('v'), { holder: 'hostB', token: lo.token });
});

/** A TCP port that is free, and (for Cluster) whose bus port +10000 is free too. */
async function freePort(withBus: boolean): Promise<number> {
  const free = (port: number): Promise<boolean> => new Promise((resolve) => {
    const srv = net.createServer().once('error', () => resolve(false)).listen(port, '127.0.0.1', () => srv.close(() => resolve(true)));
  });
  for (let i = 0; i < 50; i++) {
    const port = 20000 + Math.floor(Math.random() * 25000);
    if (await free(port) && (!withBus || await free(port + 10000))) return port;
  }
  throw new Error('no free TCP port');
}

/** redis-server (or sentinel) on 127.0.0.1:PORT, stopped in teardown. */
async function startTcpRedis(t: ExecutionContext, port: number, dir: string, args: string[], conf?: string): Promise<void> {
  const pidfile = path.join(dir, `redis-${port}.pid`);
  const argv = [...(conf ? [conf] : []), '--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--daemonize', 'yes', '--pidfile', pidfile, '--dir', dir, ...args];
  const r = spawnSync('redis-server', argv, { encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`redis-server failed: ${r.stderr}${r.stdout}`);
  t.teardown(async () => {
    try { process.kill(Number.parseInt(await fsp.readFile(pidfile, 'utf8'), 10), 'SIGKILL'); } catch { /* gone */ }
  });
  const ping = async (): Promise<boolean> => {
    const c = new Redis({ port, host: '127.0.0.1', lazyConnect: true, retryStrategy: () => null, enableOfflineQueue: false });
    c.on('error', () => {});
    try { await c.connect(); return (await c.ping()) === 'PONG'; } catch { return false; } finally { c.disconnect(); }
  };
  if (!(await until(ping, 5000, 20))) throw new Error(`redis-server on port ${port} did not answer`);
}

redisOnly('redis+cluster: hash-tagged scripts, pub/sub handoff and list across masters', async (t) => {
  const dir = await tempDir(t, 'baton-cluster-');
  const port = await freePort(true);
  await startTcpRedis(t, port, dir, ['--cluster-enabled', 'yes', '--cluster-config-file', path.join(dir, 'nodes.conf'), '--cluster-announce-ip', '127.0.0.1']);
  const admin = new Redis({ port, host: '127.0.0.1' });
  t.teardown(() => admin.disconnect());
  await admin.call('CLUSTER', 'ADDSLOTSRANGE', '0', '16383');
  t.true(await until(async () => String(await admin.call('CLUSTER', 'INFO')).includes('cluster_state:ok'), 5000, 20), 'cluster up');
  const url = `redis+cluster://127.0.0.1:${port}`;
  const a = await openRedisLeaseManager(url, { ttlMs: 3000 });
  const b = await openRedisLeaseManager(url, { ttlMs: 3000 });
  t.teardown(() => a.close());
  t.teardown(() => b.close());
  const la = await a.acquire('c1', 'hostA');
  await a.acquire('c2', 'hostA');
  await t.throwsAsync(b.acquire('c1', 'hostB'), { instanceOf: LeaseHeldError, message: /served by hostA/ });
  let ms = -1;
  const t0 = performance.now();
  la.onHandoffRequest(() => { ms = performance.now() - t0; });
  await b.requestHandoff('c1', 'hostB');
  t.true(await until(() => ms >= 0, 1000) && ms < 200, `handoff noticed after ${ms.toFixed(0)} ms`);
  t.deepEqual((await b.list()).map((r) => [r.volume, r.holder]), [['c1', 'hostA'], ['c2', 'hostA']]);
  await la.release('hostB');
  const lb = await b.acquire('c1', 'hostB');
  t.true(lb.token > la.token);
});

redisOnly('redis+sentinel: the lease goes to the master Sentinel names', async (t) => {
  const dir = await tempDir(t, 'baton-sentinel-');
  const master = await freePort(false);
  await startTcpRedis(t, master, dir, []);
  const sport = await freePort(false);
  const conf = path.join(dir, 'sentinel.conf');
  await fsp.writeFile(conf, `sentinel monitor baton 127.0.0.1 ${master} 1\n`);
  await startTcpRedis(t, sport, dir, ['--sentinel'], conf);
  const m = await openRedisLeaseManager(`redis+sentinel://127.0.0.1:${sport}/baton`, { ttlMs: 3000 });
  t.teardown(() => m.close());
  const l = await m.acquire('s', 'hostA');
  const direct = new Redis({ port: master, host: '127.0.0.1' });
  t.teardown(() => direct.disconnect());
  t.is(await direct.hget('baton:lease:{s}', 'holder'), 'hostA');
  t.is(await direct.get('baton:lease:{s}:token'), String(l.token));
  await l.release();
  t.is(await direct.exists('baton:lease:{s}'), 0);
});

// ------------------------------------------------------------------ local only

test('local: a lease whose holder process is dead is free', async (t) => {
  const dir = await tempDir(t, 'baton-lease-');
  const child = spawn(process.execPath, ['-e', '0']);
  const deadPid = await new Promise<number>((resolve) => child.on('exit', () => resolve(child.pid!)));
  await fsp.writeFile(path.join(dir, 'v.lease'), JSON.stringify({ holder: 'ghost', token: 7, pid: deadPid, hostname: os.hostname(), expiresAt: Date.now() + 60_000 }));
  const m = new LocalLeaseManager(dir, { ttlMs: 3000 });
  t.teardown(() => m.close());
  t.is(await m.inspect('v'), null);
  const l = await m.acquire('v', 'hostA');
  t.true(l.token > 7, 'above the token left in the dead holder\'s file');
  // A live pid (ours) on this host holds.
  await fsp.writeFile(path.join(dir, 'w.lease'), JSON.stringify({ holder: 'alive', token: 3, pid: process.pid, hostname: os.hostname(), expiresAt: Date.now() + 60_000 }));
  await t.throwsAsync(m.acquire('w', 'hostA'), { instanceOf: LeaseHeldError, message: /served by alive/ });
});

test('local: a stale lock left by a dead process is broken', async (t) => {
  const dir = await tempDir(t, 'baton-lease-');
  const child = spawn(process.execPath, ['-e', '0']);
  const deadPid = await new Promise<number>((resolve) => child.on('exit', () => resolve(child.pid!)));
  await fsp.writeFile(path.join(dir, 'v.lock'), JSON.stringify({ pid: deadPid, hostname: os.hostname() }));
  const old = new Date(Date.now() - 1000);
  await fsp.utimes(path.join(dir, 'v.lock'), old, old);
  const m = new LocalLeaseManager(dir, { ttlMs: 3000, lockStaleMs: 10_000 });
  t.teardown(() => m.close());
  const t0 = performance.now();
  const l = await m.acquire('v', 'hostA');
  t.true(performance.now() - t0 < 2000, 'broken at once, not after lockStaleMs');
  t.is(l.token, 1);
  t.false(fs.existsSync(path.join(dir, 'v.lock')));
});

// ------------------------------------------------------------------ URLs

test('parseRedisUrl: every accepted form', (t) => {
  t.like(parseRedisUrl('redis://10.0.0.5:6380/2'), { kind: 'single', options: { host: '10.0.0.5', port: 6380, db: 2 } });
  t.like(parseRedisUrl('redis://localhost'), { kind: 'single', options: { host: 'localhost', port: 6379 } });
  t.like(parseRedisUrl('redis://:s%40cret@h:1'), { options: { host: 'h', port: 1, password: 's@cret' } });
  t.like(parseRedisUrl('redis://u:p@h'), { options: { username: 'u', password: 'p' } });
  t.like(parseRedisUrl('redis://[::1]:7000'), { options: { host: '::1', port: 7000 } });
  t.like(parseRedisUrl('rediss://cache.example.com'), { options: { host: 'cache.example.com', port: 6379, tls: { servername: 'cache.example.com' } } });
  t.like(parseRedisUrl('unix:///run/redis/redis.sock?db=3'), { kind: 'single', options: { path: '/run/redis/redis.sock', db: 3 } });
  const s = parseRedisUrl('redis+sentinel://:pw@s1:26379,s2,[::1]:26380/mymaster/1');
  t.like(s, { kind: 'single', options: { name: 'mymaster', db: 1, password: 'pw' } });
  t.deepEqual(s.kind === 'single' ? s.options.sentinels : null, [{ host: 's1', port: 26379 }, { host: 's2', port: 26379 }, { host: '::1', port: 26380 }]);
  const c = parseRedisUrl('redis+cluster://n1:7000,n2:7001,n3');
  t.deepEqual(c.kind === 'cluster' ? c.nodes : null, [{ host: 'n1', port: 7000 }, { host: 'n2', port: 7001 }, { host: 'n3', port: 6379 }]);
  for (const bad of ['http://h', 'redis://h/x', 'unix://relative.sock', 'redis+sentinel://h1:26379', 'redis+cluster://h1:7000/0', 'nonsense']) {
    t.throws(() => parseRedisUrl(bad), { instanceOf: InvalidArgumentError }, bad);
  }
  t.is(redact('redis://user:hunter2@h:6379/0'), 'redis://user:***@h:6379/0');
  t.is(redact('redis+sentinel://:hunter2@a,b/m'), 'redis+sentinel://:***@a,b/m');
  t.false(parseRedisUrl('redis://:hunter2@h').display.includes('hunter2'));
});

/** VolumeExports over a 16 MiB volume `v` in `store`, leased from `leases` as host `h` (refuse when held). */
async function exportsOf(t: ExecutionContext, store: import('../../src/store/object-store.js').ObjectStore, leases: LeaseManager, o: { idleGraceMs: number; onEvent?: (type: string) => void }) {
  const { VolumeExports } = await import('../../src/exports.js');
  const { StoreCatalog } = await import('../../src/volume/catalog.js');
  const { BlockCache } = await import('../../src/cache.js');
  const { silentLogger } = await import('../../src/log.js');
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 16 * 1024 * 1024 }) });
  await catalog.create('v', 16 * 1024 * 1024);
  const exports = new VolumeExports(catalog, {
    readOnly: false, idleGraceMs: o.idleGraceMs, log: silentLogger(), lease: { manager: leases, hostId: 'h', onHeld: 'refuse', waitMs: 0 },
    ...(o.onEvent ? { onEvent: (ev: { type: string }) => o.onEvent!(ev.type) } : {}),
  });
  t.teardown(() => exports.close());
  return exports;
}

test('exports: a client attaching while the volume is being closed for idleness waits for the close, then gets it', async (t) => {
  const { FaultyObjectStore } = await import('../../src/store/decorators.js');
  const { MemoryObjectStore } = await import('../../src/store/memory.js');
  const dir = await tempDir(t, 'baton-lease-');
  const leases = new LocalLeaseManager(dir, { ttlMs: 3000 });
  t.teardown(() => leases.close());
  // Every request takes 300 ms: the idle close flushes (10-310 ms), then writes a checkpoint
  // (310-610 ms) and only then releases the lease.
  const exports = await exportsOf(t, new FaultyObjectStore(new MemoryObjectStore(), { latencyMs: 300 }), leases, { idleGraceMs: 10 });
  const first = await exports.open('v');
  await first.backend.write(0, Buffer.alloc(4096, 7), false);
  first.release(); // idle close starts after 10 ms and takes several slow puts
  await new Promise((r) => setTimeout(r, 450)); // closing: no longer served, lease still held
  const second = await exports.open('v');
  t.true((await second.backend.read(0, 4096)).equals(Buffer.alloc(4096, 7)), 'the write made before the close is there');
  second.release();
});

test('exports: a volume whose lease ran out in a stall is attached again at once, not refused as held under this host id', async (t) => {
  const { MemoryObjectStore } = await import('../../src/store/memory.js');
  const dir = await tempDir(t, 'baton-lease-');
  // No renewals: the served volume loses its lease at its deadline (2.4 s), as a host whose
  // event loop stalled past it would; the lease file says "held" until 3 s.
  const ttl = 3000;
  const leases = new LocalLeaseManager(dir, { ttlMs: ttl, renew: false });
  t.teardown(() => leases.close());
  const events: string[] = [];
  const exports = await exportsOf(t, new MemoryObjectStore(), leases, { idleGraceMs: 60_000, onEvent: (type) => events.push(type) });
  const first = await exports.open('v');
  await first.backend.write(0, Buffer.alloc(4096, 7), false);
  await first.backend.flush();
  const token = (await leases.inspect('v'))!.token;
  t.true(await until(() => exports.stateOf('v') === null, ttl + 1000), 'fenced and dropped at the deadline');
  t.true(events.includes('leaseLost'), events.join(' '));
  first.release();
  // Well before the file's own expiry: without the release of a lost lease this attach was
  // refused ("already served under this host id h").
  const second = await exports.open('v');
  t.true((await second.backend.read(0, 4096)).equals(Buffer.alloc(4096, 7)), 'the flushed write is there');
  t.true((await leases.inspect('v'))!.token > token);
  second.release();
});
