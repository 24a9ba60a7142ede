/**
 * Regression tests for the lease holes of issue 17 (items 3, 4, 5) and LeaseManager.revoke:
 *
 * - 17.3: one parser for store URLs; the local lease directory is the store's own directory
 *   (+ `.leases`) for every spelling of a `file:` store and from any working directory.
 * - 17.4: lease files expire on CLOCK_MONOTONIC (with the boot id), not on the wall clock:
 *   a wall-clock step forward does not free a held lease, nor break a held lock.
 * - 17.5: a handoff is acted on only if the lease record in Redis says so, never because of
 *   a PUBLISH on the handoff channel.
 * - revoke (`rm --force`): the holder loses the lease at its next renewal, tokens keep growing.
 *
 * Redis cases use a real redis-server (test/helpers/redis.ts; skipped when not installed).
 * Tests that step Date.now, change $HOME or the working directory are serial: ava runs them
 * before the concurrent ones, so nothing else in this process sees the change.
 */
import test, { type ExecutionContext } from 'ava';
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { performance } from 'node:perf_hooks';
import { Redis } from 'ioredis';
import { openCatalog } from '../../src/catalog.js';
import { InvalidArgumentError, LeaseHeldError } from '../../src/errors.js';
import type { Lease, LeaseManager } from '../../src/lease/lease.js';
import { LocalLeaseManager } from '../../src/lease/local.js';
import { localLeaseDir, openLeaseManager } from '../../src/lease/open.js';
import { openRedisLeaseManager } from '../../src/lease/redis.js';
import type { RenewingLease } from '../../src/lease/renewing.js';
import { LocalDirObjectStore } from '../../src/store/local-dir.js';
import { SettingsCheckedObjectStore } from '../../src/store/probe.js';
import { openStore } from '../../src/store/open.js';
import { FileCatalog } from '../../src/volumes.js';
import { hasRedis, startRedis, type RedisServer } from '../helpers/redis.js';
import { tempDir } from '../helpers/server.js';

const HAS_REDIS = hasRedis();
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const renewNow = (l: Lease): Promise<boolean> => (l as RenewingLease).renewNow();

async function until(cond: () => boolean | Promise<boolean>, timeoutMs: number, stepMs = 5): Promise<boolean> {
  const end = performance.now() + timeoutMs;
  while (performance.now() < end) {
    if (await cond()) return true;
    await sleep(stepMs);
  }
  return cond();
}

/** The store directory openStore gives for `url`, and the lease directory beside it. */
function storeDir(url: string): string {
  let s = openStore(url);
  if (s instanceof SettingsCheckedObjectStore) s = s.next; // the settings check wraps every persistent store
  if (!(s instanceof LocalDirObjectStore)) throw new Error(`${url} is not a local store`);
  return s.root;
}

/** Run `fn` with $HOME (os.homedir()) and the working directory changed, then restore both. */
async function withHomeAndCwd<T>(home: string, cwd: string, fn: () => Promise<T> | T): Promise<T> {
  const savedHome = process.env.HOME;
  const savedCwd = process.cwd();
  process.env.HOME = home;
  process.chdir(cwd);
  try {
    return await fn();
  } finally {
    process.chdir(savedCwd);
    if (savedHome === undefined) delete process.env.HOME; else process.env.HOME = savedHome;
  }
}

// ------------------------------------------------------------------ 17.3: one parser for store URLs

test.serial('17.3: every spelling of a file: store, from any working directory, has its lease directory in the store directory', async (t) => {
  const root = tempDir(t, 'baton-urls-');
  const home = path.join(root, 'home');
  const cwdA = path.join(root, 'a');
  const cwdB = path.join(root, 'b');
  for (const d of [home, cwdA, cwdB]) fs.mkdirSync(d);
  for (const cwd of [cwdA, cwdB]) {
    await withHomeAndCwd(home, cwd, () => {
      const cases: [string, string][] = [
        ['file:~/x', path.join(home, 'x')],
        ['file:~', home],
        [`file://localhost${root}/x`, path.join(root, 'x')],
        [`file://LOCALHOST${root}/x`, path.join(root, 'x')],
        [`file://${root}/a%20b`, path.join(root, 'a b')],
        [`file:${root}/a%20b`, path.join(root, 'a%20b')], // file:PATH is a path, as the store always read it
        [`file:${root}/x`, path.join(root, 'x')],
        ['file:rel/store', path.join(cwd, 'rel', 'store')],
      ];
      for (const [url, dir] of cases) {
        t.is(storeDir(url), dir, url);
        t.is(localLeaseDir(url), path.join(dir, '.leases'), `${url} from ${cwd}`);
      }
    });
  }
});

test.serial('17.3: two processes on file:~/store from different working directories cannot both hold a volume', async (t) => {
  const root = tempDir(t, 'baton-urls-');
  const home = path.join(root, 'home');
  const cwdA = path.join(root, 'a');
  const cwdB = path.join(root, 'b');
  for (const d of [home, cwdA, cwdB]) fs.mkdirSync(d);
  const open = (cwd: string): Promise<LeaseManager> => withHomeAndCwd(home, cwd, async () => {
    const m = await openLeaseManager({ storeUrl: 'file:~/store', ttlMs: 3000 });
    t.teardown(() => m.close());
    return m;
  });
  const a = await open(cwdA);
  const b = await open(cwdB);
  const la = await a.acquire('work', 'hostA');
  await t.throwsAsync(b.acquire('work', 'hostB'), { instanceOf: LeaseHeldError, message: new RegExp(`served by hostA \\(token ${la.token},`) });
  // `status` and `rm` (inspect, list) see it from the other directory too.
  t.like(await b.inspect('work'), { holder: 'hostA', token: la.token });
  t.deepEqual((await b.list()).map((r) => r.volume), ['work']);
  t.true(fs.existsSync(path.join(home, 'store', '.leases', 'work.lease')));
});

test.serial('17.3: raw: paths follow the same rules as file:', async (t) => {
  const root = tempDir(t, 'baton-urls-');
  await withHomeAndCwd(root, root, () => {
    const c = openCatalog('raw:~/plain');
    t.true(c instanceof FileCatalog);
    t.is((c as FileCatalog).dir, path.join(root, 'plain'));
    t.is((openCatalog(`raw://localhost${root}/a%20b`) as FileCatalog).dir, path.join(root, 'a b'));
  });
});

test('17.3: other stores: one lease directory per store, whatever its spelling', (t) => {
  t.is(localLeaseDir('s3://bucket-1/p'), localLeaseDir('s3://bucket-1/p/'));
  t.is(localLeaseDir('s3://bucket-1'), localLeaseDir('s3://bucket-1/'));
  t.not(localLeaseDir('s3://bucket-1/p'), localLeaseDir('s3://bucket-1/q'));
  t.not(localLeaseDir('s3://bucket-1/p'), localLeaseDir('s3://bucket-2/p'));
  t.is(localLeaseDir('memory:'), localLeaseDir('memory://'));
  t.true(path.isAbsolute(localLeaseDir('s3://bucket-1/p')));
});

test('17.3: a store URL of no known kind names every accepted scheme, wherever it is parsed', async (t) => {
  const every = [/file:DIR/, /s3:\/\/bucket\[\/prefix\]/, /memory:/, /ram:/, /raw:DIR/];
  const errors = [
    t.throws(() => openStore('bogus:x'), { instanceOf: InvalidArgumentError }),
    t.throws(() => openCatalog('bogus:x'), { instanceOf: InvalidArgumentError }),
    t.throws(() => localLeaseDir('bogus:x'), { instanceOf: InvalidArgumentError }),
    await t.throwsAsync(openLeaseManager({ storeUrl: 'bogus:x', ttlMs: 3000 }), { instanceOf: InvalidArgumentError }),
    t.throws(() => openCatalog('ram'), { instanceOf: InvalidArgumentError }),
  ];
  for (const err of errors) {
    for (const re of every) t.regex(err!.message, re);
  }
  t.regex(errors[0]!.message, /"bogus:"/);
  // Not object stores: a clear message, not "unknown".
  t.regex(t.throws(() => openStore('ram:'), { instanceOf: InvalidArgumentError })!.message, /plain backend/);
  t.throws(() => openStore('file://elsewhere/x'), { instanceOf: InvalidArgumentError, message: /another host/ });
  t.throws(() => openStore('file:///a%zz'), { instanceOf: InvalidArgumentError, message: /%25/ });
  t.throws(() => openCatalog('raw:'), { instanceOf: InvalidArgumentError, message: /no directory/ });
});

// ------------------------------------------------------------------ 17.4: clocks of lease files

function bootId(): string | null {
  try { return fs.readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim(); } catch { return null; }
}

test.serial('17.4: a forward wall-clock step longer than the TTL frees no held lease and expires no holder', async (t) => {
  const dir = tempDir(t, 'baton-lease-');
  const ttl = 3000;
  const a = new LocalLeaseManager(dir, { ttlMs: ttl });
  const b = new LocalLeaseManager(dir, { ttlMs: ttl });
  t.teardown(() => a.close());
  t.teardown(() => b.close());
  const la = await a.acquire('v', 'hostA');
  let lost = '';
  la.onLost((r) => { lost = r; });
  const realNow = Date.now;
  const step = 10 * ttl;
  Date.now = () => realNow.call(Date) + step; // an NTP step, a VM resume
  try {
    await t.throwsAsync(b.acquire('v', 'hostB'), { instanceOf: LeaseHeldError, message: /served by hostA/ });
    const rec = await b.inspect('v');
    t.like(rec, { holder: 'hostA', token: la.token });
    t.true(rec!.ttlMs > 0 && rec!.ttlMs <= ttl, `ttl left ${rec?.ttlMs}`);
    t.true(await renewNow(la), 'the holder renews across the step');
    t.is(lost, '');
    await t.throwsAsync(b.acquire('v', 'hostB'), { instanceOf: LeaseHeldError });
    // A backward step does not keep a released lease held either.
    await la.release();
    Date.now = () => realNow.call(Date) - step;
    const lb = await b.acquire('v', 'hostB');
    t.true(lb.token > la.token);
  } finally {
    Date.now = realNow;
  }
});

test.serial('17.4: a wall-clock step does not make a lock held a moment ago look abandoned', async (t) => {
  const id = bootId();
  if (id === null) { t.pass('no boot id on this system: locks are dated by mtime, as before'); return; }
  const dir = tempDir(t, 'baton-lease-');
  const m = new LocalLeaseManager(dir, { ttlMs: 3000, lockStaleMs: 10_000 });
  t.teardown(() => m.close());
  // Another live process of this boot holds the lock right now (our pid stands in for it).
  const lock = path.join(dir, 'v.lock');
  await fsp.writeFile(lock, JSON.stringify({ pid: process.pid, hostname: os.hostname(), bootId: id, at: Number(process.hrtime.bigint() / 1_000_000n) }));
  const realNow = Date.now;
  Date.now = () => realNow.call(Date) + 3_600_000;
  try {
    const acq = m.acquire('v', 'hostA');
    acq.catch(() => {});
    // The lock is not stale for 10 s of monotonic time, so nothing may acquire meanwhile;
    // breaking it on the stepped wall clock would acquire within milliseconds.
    const first = await Promise.race([acq.then(() => 'acquired'), sleep(400).then(() => 'waiting')]);
    t.is(first, 'waiting');
    await fsp.unlink(lock);
    const l = await acq;
    t.is(l.token, 1);
  } finally {
    Date.now = realNow;
  }
});

test('17.4: lease files carry the boot id and a monotonic expiry; older files are read as before', async (t) => {
  const dir = tempDir(t, 'baton-lease-');
  const m = new LocalLeaseManager(dir, { ttlMs: 3000 });
  t.teardown(() => m.close());
  const write = (vol: string, o: Record<string, unknown>): Promise<void> => fsp.writeFile(path.join(dir, `${vol}.lease`), JSON.stringify(o));
  const id = bootId();
  const mono = Number(process.hrtime.bigint() / 1_000_000n);

  const l = await m.acquire('fresh', 'hostA');
  const f = JSON.parse(await fsp.readFile(path.join(dir, 'fresh.lease'), 'utf8')) as Record<string, number | string>;
  t.true(typeof f.expiresAt === 'number', 'the wall-clock expiry is still written, for older readers');
  if (id !== null) {
    t.is(f.bootId, id);
    t.true(Math.abs((f.monoExpiresAt as number) - (mono + 3000)) < 2000, `monoExpiresAt ${f.monoExpiresAt} vs ${mono + 3000}`);
  }
  await l.release();

  // Old format (no boot id), still valid by the wall clock, holder alive: held, as before.
  await write('old', { holder: 'old', token: 5, pid: process.pid, hostname: os.hostname(), expiresAt: Date.now() + 60_000 });
  await t.throwsAsync(m.acquire('old', 'hostA'), { instanceOf: LeaseHeldError, message: /served by old/ });
  // Old format, expired by the wall clock: free, and the next token is above it.
  await write('oldx', { holder: 'old', token: 5, pid: process.pid, hostname: os.hostname(), expiresAt: Date.now() - 1 });
  t.is((await m.acquire('oldx', 'hostA')).token, 6);
  // Unreadable: free, as before.
  await fsp.writeFile(path.join(dir, 'junk.lease'), '{"holder": ');
  t.is(await m.inspect('junk'), null);

  if (id === null) return;
  // Written on this machine before a reboot (another boot id, our hostname): expired, even
  // though its wall-clock expiry is an hour away and its pid now belongs to a live process.
  await write('boot', { holder: 'prev', token: 9, pid: process.pid, hostname: os.hostname(), expiresAt: Date.now() + 3_600_000, bootId: 'ffffffff-0000-0000-0000-000000000000', monoExpiresAt: mono + 3_600_000 });
  t.is(await m.inspect('boot'), null);
  t.is((await m.acquire('boot', 'hostA')).token, 10);
  // Written by another machine sharing the directory: only the wall clock is common.
  await write('far', { holder: 'far', token: 2, pid: 1, hostname: `not-${os.hostname()}`, expiresAt: Date.now() + 60_000, bootId: 'eeeeeeee-0000-0000-0000-000000000000', monoExpiresAt: 0 });
  await t.throwsAsync(m.acquire('far', 'hostA'), { instanceOf: LeaseHeldError, message: /served by far/ });
  // Same boot: the monotonic expiry decides, whatever the wall-clock field says.
  await write('mono', { holder: 'm', token: 3, pid: process.pid, hostname: os.hostname(), expiresAt: Date.now() - 60_000, bootId: id, monoExpiresAt: mono + 60_000 });
  await t.throwsAsync(m.acquire('mono', 'hostA'), { instanceOf: LeaseHeldError, message: /served by m/ });
  await write('monox', { holder: 'm', token: 3, pid: process.pid, hostname: os.hostname(), expiresAt: Date.now() + 60_000, bootId: id, monoExpiresAt: mono - 1 });
  t.is((await m.acquire('monox', 'hostA')).token, 4);
});

// ------------------------------------------------------------------ 17.5: handoffs come from the record

const redisTest = HAS_REDIS ? test : test.skip;

async function redisManager(t: ExecutionContext, server: RedisServer, o: { ttlMs?: number; renew?: boolean } = {}): Promise<LeaseManager> {
  const m = await openRedisLeaseManager(server.url, { ttlMs: o.ttlMs ?? 3000, ...(o.renew === false ? { renew: false } : {}) });
  t.teardown(() => m.close());
  return m;
}

redisTest('17.5: a forged PUBLISH on the handoff channel triggers no handoff; a real request still does, at once', async (t) => {
  const server = await startRedis(t);
  // No scheduled renewals: the only way the holder can learn of a request is pub/sub.
  const a = await redisManager(t, server, { ttlMs: 10_000, renew: false });
  const b = await redisManager(t, server);
  const l = await a.acquire('v', 'hostA');
  const calls: string[] = [];
  l.onHandoffRequest((to) => { calls.push(to); });
  const forge = (o: Record<string, unknown>): Promise<unknown> => server.command('PUBLISH', 'baton:handoff:{v}', JSON.stringify({ type: 'handoff', token: String(l.token), ...o }));
  // What an attacker with PUBLISH can send: to the holder itself (the script refuses that),
  // and to a host nobody asked for.
  await forge({ to: 'hostA', id: 'forged-1' });
  await forge({ to: 'hostZ', id: 'forged-2' });
  await forge({ type: 'revoked' });
  const t0 = performance.now();
  await b.requestHandoff('v', 'hostB');
  t.true(await until(() => calls.length > 0, 5000), 'the real request was noticed');
  const ms = performance.now() - t0;
  t.true(ms < 2000, `noticed after ${ms.toFixed(0)} ms`);
  await renewNow(l); // anything the forged messages could still cause has happened now
  t.deepEqual(calls, ['hostB']);
  t.true(l.validUntil() > performance.now(), 'a forged "revoked" does not end the lease');
  t.like(await b.inspect('v'), { holder: 'hostA', token: l.token, handoffRequestedBy: 'hostB' });
});

redisTest('17.5: a flood of messages costs one renewal at a time, not one per message', async (t) => {
  const server = await startRedis(t);
  const a = await redisManager(t, server, { ttlMs: 10_000, renew: false });
  const l = await a.acquire('v', 'hostA');
  // Count the messages the lease receives, and hold the first renewal until all have arrived.
  const inner = l as unknown as { renewOnce: (s: unknown) => Promise<unknown>; message: (m: Record<string, unknown>) => void };
  let messages = 0;
  const onMessage = inner.message.bind(l);
  inner.message = (m) => { messages++; onMessage(m); };
  let renewals = 0;
  let open!: () => void;
  const gate = new Promise<void>((r) => { open = r; });
  const renew = inner.renewOnce.bind(l);
  inner.renewOnce = async (s) => { renewals++; await gate; return renew(s); };
  const msg = JSON.stringify({ type: 'handoff', to: 'hostZ', id: 'x', token: String(l.token) });
  const pub = new Redis({ path: server.socket });
  t.teardown(() => pub.disconnect());
  await Promise.all(Array.from({ length: 200 }, () => pub.publish('baton:handoff:{v}', msg)));
  t.true(await until(() => messages === 200, 5000), `${messages} messages arrived`);
  open();
  // Renewals run one after another: these two run after every re-check the flood queued.
  await renewNow(l);
  await renewNow(l);
  t.true(renewals <= 4, `${renewals} renewals for 200 messages (2 of them ours)`);
  t.true(l.validUntil() > performance.now());
});

// ------------------------------------------------------------------ revoke (rm --force)

interface Env {
  kind: 'redis' | 'local';
  make(o?: { ttlMs?: number; renew?: boolean }): Promise<LeaseManager>;
  /** Leave a lease record by hand, as another (older, crashed) writer would. */
  plant(vol: string, holder: string, token: number, expired: boolean): Promise<void>;
  server?: RedisServer;
}

async function makeEnv(t: ExecutionContext, kind: 'redis' | 'local'): Promise<Env> {
  if (kind === 'redis') {
    const server = await startRedis(t);
    return {
      kind,
      server,
      make: (o) => redisManager(t, server, o),
      async plant(vol, holder, token, expired) {
        await server.command('HSET', `baton:lease:{${vol}}`, 'holder', holder, 'token', String(token));
        if (expired) await server.command('PEXPIRE', `baton:lease:{${vol}}`, 1);
        else await server.command('PEXPIRE', `baton:lease:{${vol}}`, 60_000);
      },
    };
  }
  const dir = tempDir(t, 'baton-lease-');
  return {
    kind,
    async make(o = {}) {
      const m = new LocalLeaseManager(dir, { ttlMs: o.ttlMs ?? 3000, ...(o.renew === false ? { renew: false } : {}) });
      t.teardown(() => m.close());
      return m;
    },
    async plant(vol, holder, token, expired) {
      await fsp.mkdir(dir, { recursive: true });
      await fsp.writeFile(path.join(dir, `${vol}.lease`), JSON.stringify({ holder, token, pid: process.pid, hostname: os.hostname(), expiresAt: Date.now() + (expired ? -1000 : 60_000) }));
    },
  };
}

function both(title: string, fn: (t: ExecutionContext, e: Env) => Promise<void>): void {
  for (const kind of ['redis', 'local'] as const) {
    (kind === 'redis' && !HAS_REDIS ? test.skip : test)(`${kind}: ${title}`, async (t) => fn(t, await makeEnv(t, kind)));
  }
}

both('revoke: the holder loses the lease at its next renewal; a new acquire gets a higher token', async (t, e) => {
  const a = await e.make({ ttlMs: 10_000, renew: false });
  const b = await e.make();
  const l = await a.acquire('v', 'hostA');
  let reason = '';
  l.onLost((r) => { reason = r; });
  t.true(await b.revoke('v'));
  t.is(await b.inspect('v'), null);
  t.false(await renewNow(l), 'its next renewal fails');
  t.regex(reason, /revoked/);
  t.is(l.validUntil(), -Infinity);
  const lb = await b.acquire('v', 'hostB');
  t.true(lb.token > l.token, `${lb.token} > ${l.token}`);
  // The old holder's late release must not touch the new lease.
  await l.release();
  t.like(await b.inspect('v'), { holder: 'hostB', token: lb.token });
  t.false(await b.revoke('nothing-here'));
});

both('revoke of a reservation left by a handoff: false, the reservation is gone, tokens still grow', async (t, e) => {
  const a = await e.make();
  const b = await e.make();
  const l = await a.acquire('v', 'hostA');
  await l.release('hostB');
  await t.throwsAsync(b.acquire('v', 'hostC'), { instanceOf: LeaseHeldError, message: /reserved for it/ });
  t.false(await b.revoke('v'), 'nobody held it');
  const lc = await b.acquire('v', 'hostC');
  t.true(lc.token > l.token);
});

both('revoke of an expired lease: false, and the next token is above the one it carried', async (t, e) => {
  const m = await e.make();
  // A record whose token the counter never saw (written by another tool, or the counter was lost).
  await e.plant('v', 'ghost', 41, true);
  if (e.kind === 'redis') await sleep(20); // PEXPIRE 1 ms
  t.false(await m.revoke('v'));
  await e.plant('w', 'ghost', 41, false);
  t.true(await m.revoke('w'));
  t.true((await m.acquire('w', 'hostA')).token > 41);
});

test('local: revoke on a store whose lease directory does not exist yet', async (t) => {
  const dir = path.join(tempDir(t, 'baton-lease-'), 'not', 'yet');
  const m = new LocalLeaseManager(dir, { ttlMs: 3000 });
  t.teardown(() => m.close());
  t.false(await m.revoke('v'));
  await t.throwsAsync(m.revoke('bad/name'), { instanceOf: InvalidArgumentError });
});

redisTest('redis: revoke reaches the holder at once (pub/sub), without waiting for a renewal', async (t) => {
  const server = await startRedis(t);
  const a = await redisManager(t, server, { ttlMs: 10_000, renew: false });
  const b = await redisManager(t, server);
  const l = await a.acquire('v', 'hostA');
  let reason = '';
  l.onLost((r) => { reason = r; });
  t.true(await b.revoke('v'));
  t.true(await until(() => reason !== '', 3000), 'onLost fired');
  t.regex(reason, /revoked/);
  t.is(String(await server.command('GET', 'baton:lease:{v}:token')), String(l.token), 'the counter is kept');
});

// Redis Cluster: the revoke script touches two keys; they must share a slot ({VOL} hash tag).

async function freePort(): Promise<number> {
  const free = (port: number): Promise<boolean> => new Promise((resolve) => {
    const srv = net.createServer().once('error', () => resolve(false)).listen(port, '127.0.0.1', () => srv.close(() => resolve(true)));
  });
  for (let i = 0; i < 50; i++) {
    const port = 20000 + Math.floor(Math.random() * 25000);
    if (await free(port) && await free(port + 10000)) return port;
  }
  throw new Error('no free TCP port');
}

redisTest('redis+cluster: revoke keeps the counter in the volume\'s slot', async (t) => {
  const dir = tempDir(t, 'baton-cluster-');
  const port = await freePort();
  const pidfile = path.join(dir, 'redis.pid');
  const r = spawnSync('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--daemonize', 'yes',
    '--pidfile', pidfile, '--dir', dir, '--cluster-enabled', 'yes', '--cluster-config-file', path.join(dir, 'nodes.conf'), '--cluster-announce-ip', '127.0.0.1'], { encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`redis-server failed: ${r.stderr}${r.stdout}`);
  t.teardown(async () => {
    try { process.kill(Number.parseInt(await fsp.readFile(pidfile, 'utf8'), 10), 'SIGKILL'); } catch { /* gone */ }
  });
  // The client connects and reconnects by itself until redis-server listens (daemonized, it
  // may not yet). Calling connect() again instead fails once the first try is under way
  // ("already connecting"), so a redis that came up a moment late was never seen.
  const admin = new Redis({ port, host: '127.0.0.1', retryStrategy: () => 50 });
  admin.on('error', () => {});
  t.teardown(() => admin.disconnect());
  t.true(await until(async () => admin.status === 'ready', 20_000, 50), 'redis up'); // generous: a loaded CI machine
  await admin.call('CLUSTER', 'ADDSLOTSRANGE', '0', '16383');
  t.true(await until(async () => String(await admin.call('CLUSTER', 'INFO')).includes('cluster_state:ok'), 20_000, 20), 'cluster up');
  const url = `redis+cluster://127.0.0.1:${port}`;
  const a = await openRedisLeaseManager(url, { ttlMs: 3000 });
  const b = await openRedisLeaseManager(url, { ttlMs: 3000 });
  t.teardown(() => a.close());
  t.teardown(() => b.close());
  const la = await a.acquire('c1', 'hostA');
  let reason = '';
  la.onLost((x) => { reason = x; });
  t.true(await b.revoke('c1'));
  t.true(await until(() => reason !== '', 3000), 'onLost fired');
  const lb = await b.acquire('c1', 'hostB');
  t.true(lb.token > la.token);
  await t.notThrowsAsync(b.revoke('c1'));
});
