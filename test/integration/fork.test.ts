/**
 * Forks and snapshots end to end, with real clients on real `baton serve` processes over a
 * `file:` store (what a user runs):
 *
 * 1. A live ext4 volume under an fsync loop (nbdfuse + loop + mount on server A) is forked
 *    while the loop keeps writing; a second server process serves the fork; it mounts
 *    (journal replay), passes e2fsck, has every file fsync'd before the fork, and parent and
 *    fork then diverge without seeing each other's writes.
 * 2. A git workspace forked three ways: each fork commits its own change; git fsck and git
 *    log on all four; diff and space accounting; rm of two forks leaves the others whole.
 * 3. Snapshots: read-only over NBD (flag, EPERM on the wire, qemu-io refused), old content,
 *    exact diff, forkable; the parent's removal keeps what the snapshot and its forks map.
 * 4. A chain 50 forks deep, each generation served and written: every read correct; fio
 *    read latency of the deepest fork vs the root is logged (the timing lives in bench/fork.ts).
 * 5. Block level: a fork made while a checksummed writer hammers the volume holds exactly the
 *    writes acknowledged by a FLUSH before `baton fork` started (or ones sent while it ran),
 *    and nothing else; then both sides diverge.
 * 6. `baton rm` racing `baton fork`/`baton snapshot` of the same volume (a bug at 123d2e1).
 *
 * Mount tests run serially (loop devices, mounts); the others run concurrently after them.
 */

import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { openStoreCatalog } from '../../src/catalog.js';
import { isBatonError } from '../../src/errors.js';
import type { ObjectStore, PutOptions } from '../../src/store/object-store.js';
import { GC_TEST_ENV, gcUntilQuiet, storeObjectBytes } from '../helpers/gc.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { BlockCache } from '../../src/cache.js';
import { silentLogger } from '../../src/log.js';
import { LocalDirObjectStore } from '../../src/store/local-dir.js';
import { attachExport, detachExport, mountExt4, run, runOk, sha256, sha256File, type Mount, type Stack, type RunResult } from '../helpers/ext4.js';
import { CMD, ERRNO, SIMPLE_REPLY_MAGIC, TFLAG, requestFrame } from '../helpers/nbd-raw.js';
import { BATON_BIN, has, startBatonServer, tempDir, type BatonServer, type Teardown } from '../helpers/server.js';
import { BLOCK, BlockModel, connectGo, describeProblems, rngFrom, runWriter, verifyVolume } from '../helpers/writer.js';

const MiB = 1024 * 1024;
const GIT = ['-c', 'user.name=baton test', '-c', 'user.email=baton@example.invalid', '-c', 'init.defaultBranch=main', '-c', 'safe.directory=*'];

const MOUNT_TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'dumpe2fs', 'mount', 'umount', 'git', 'nbdcopy'];
const missingMount = MOUNT_TOOLS.filter((tool) => !has(tool));
const isRoot = process.getuid?.() === 0;
const canMount = isRoot && missingMount.length === 0 && fs.existsSync('/dev/fuse') && fs.existsSync('/dev/loop-control');
const serial = canMount ? test.serial : test.serial.skip;
if (!canMount) console.warn(`fork (ext4 tests): skipped (root: ${isRoot}, missing tools: ${missingMount.join(', ') || 'none'}, /dev/fuse: ${fs.existsSync('/dev/fuse')})`);
const canQemu = has('qemu-io') && has('nbdinfo') && has('nbdcopy');
const withQemu = canQemu ? test : test.skip;
const canFio = canQemu && has('fio');
const withFio = canFio ? test : test.skip;

// ------------------------------------------------------------------ small helpers

/** `baton ARGS` without blocking the event loop (writers in this process keep running meanwhile). */
function cli(args: string[], timeoutMs = 60_000): Promise<RunResult> {
  return run(process.execPath, [BATON_BIN, ...args], { timeoutMs });
}

async function cliOk(args: string[]): Promise<RunResult> {
  const r = await cli(args);
  if (r.code !== 0) throw new Error(`baton ${args.join(' ')} exited ${r.code ?? r.signal}: ${r.output}`);
  return r;
}

/**
 * `baton rm` of a volume a client just left: the serving host gives its lease back after
 * --idle-grace, and rm refuses while it is held ("is being served by ... then retry"). Retry
 * as the message says, for a while (a loaded machine closes the idle volume late).
 */
async function rmOnceReleased(name: string, store: string): Promise<RunResult> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    const r = await cli(['rm', name, '--store', store]);
    if (r.code === 0 || !/is being served by/.test(r.output) || Date.now() > deadline) {
      if (r.code !== 0) throw new Error(`baton rm ${name} exited ${r.code ?? r.signal}: ${r.output}`);
      return r;
    }
    await new Promise((res) => setTimeout(res, 200));
  }
}

async function cliJson<T>(args: string[]): Promise<T> {
  return JSON.parse((await cliOk([...args, '--json'])).stdout) as T;
}

interface VolJson { name: string; kind: string; size: number; writtenBytes?: number; exclusiveBytes?: number; sharedBytes?: number; exclusiveStoredBytes?: number; parent?: { id: string; seq: number } }
interface DiffJson { a: string; b: string; differentBytes: number; ranges: { offset: number; length: number }[] }

/** A server on `store` with its own read cache (two servers must never share one). */
async function serverOn(t: Teardown, store: string, extra: string[] = [], volumes: { name: string; size: number }[] = []): Promise<BatonServer> {
  return startBatonServer(t, { store, volumes, extraArgs: ['--cache-dir', tempDir(t, 'baton-fork-cache-'), ...extra] });
}

function newStore(t: Teardown): string {
  return `file:${path.join(tempDir(t, 'baton-fork-store-'), 'store')}`;
}

/** nbdfuse + loop for one export. */
function attach(t: Teardown, server: BatonServer, name: string, size: number): Promise<Stack> {
  return attachExport(t, server.uri(name), tempDir(t, 'baton-fork-fuse-'), size);
}

const detach = detachExport;

/** mount -o OPTS, with an idempotent teardown registered at once. */
function mountWith(t: Teardown, dev: string, dir: string, options: string): Promise<Mount> {
  return mountExt4(t, dev, dir, options);
}

async function writeFileSynced(file: string, data: Buffer | string): Promise<void> {
  const fh = await fsp.open(file, 'w');
  try {
    await fh.writeFile(data);
    await fh.sync();
  } finally {
    await fh.close();
  }
}

async function syncDir(dir: string): Promise<void> {
  const fh = await fsp.open(dir, 'r');
  try { await fh.sync(); } finally { await fh.close(); }
}

async function fileHash(file: string): Promise<string | null> {
  try { return await sha256File(file); } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return null;
    throw err;
  }
}

/** { relative path: sha256 } of every regular file under root, skipping .git and lost+found. */
async function hashTree(root: string, skip = new Set(['.git', 'lost+found'])): Promise<Map<string, string>> {
  const out = new Map<string, string>();
  const walk = async (rel: string): Promise<void> => {
    for (const e of await fsp.readdir(path.join(root, rel), { withFileTypes: true })) {
      const r = path.join(rel, e.name);
      if (e.isDirectory()) { if (!skip.has(e.name)) await walk(r); }
      else if (e.isFile()) out.set(r, await sha256File(path.join(root, r)));
    }
  };
  await walk('');
  return out;
}

async function e2fsckClean(t: ExecutionContext, dev: string, what: string): Promise<void> {
  const r = await run('e2fsck', ['-fn', dev], { timeoutMs: 120_000 });
  t.is(r.code, 0, `e2fsck -fn of ${what}: ${r.output}`);
}

/** Copy an export to a local file (holes stay holes). */
async function copyOut(server: BatonServer, name: string, file: string): Promise<void> {
  await runOk('nbdcopy', [server.uri(name), file], { timeoutMs: 120_000 });
}

/**
 * Soundness of `baton diff`: every byte outside the reported ranges is equal in both images
 * (the diff may over-report, never miss). Returns the bytes that really differ.
 */
async function checkDiffCovers(t: ExecutionContext, fileA: string, fileB: string, ranges: { offset: number; length: number }[], what: string): Promise<number> {
  const [a, b] = await Promise.all([fsp.readFile(fileA), fsp.readFile(fileB)]);
  t.is(a.length, b.length);
  const inDiff = new Uint8Array(Math.ceil(a.length / 512));
  for (const r of ranges) {
    t.true(r.offset >= 0 && r.length > 0 && r.offset + r.length <= a.length, `${what}: range ${r.offset}+${r.length} inside the volume`);
    for (let s = Math.floor(r.offset / 512); s < Math.ceil((r.offset + r.length) / 512); s++) inDiff[s] = 1;
  }
  let missed = 0;
  let firstMissed = -1;
  let differing = 0;
  for (let s = 0; s < inDiff.length; s++) {
    const x = a.subarray(s * 512, s * 512 + 512);
    const y = b.subarray(s * 512, s * 512 + 512);
    if (x.equals(y)) continue;
    differing += 512;
    if (!inDiff[s]) { missed++; if (firstMissed < 0) firstMissed = s * 512; }
  }
  t.is(missed, 0, `${what}: ${missed} sectors differ outside the diff's ranges (first at byte ${firstMissed})`);
  return differing;
}

function qemuIo(uri: string, cmds: string[], readOnly = false): Promise<RunResult> {
  return run('qemu-io', [...(readOnly ? ['-r'] : []), '-f', 'raw', ...cmds.flatMap((c) => ['-c', c]), uri], { timeoutMs: 60_000 });
}

/** qemu-io prints "Pattern verification failed" but may still exit 0: check the text too. */
async function qemuIoOk(t: ExecutionContext, uri: string, cmds: string[], readOnly = false): Promise<void> {
  const r = await qemuIo(uri, cmds, readOnly);
  t.is(r.code, 0, r.output);
  t.notRegex(r.output, /Pattern verification failed|error|failed/i, r.output);
}

// ------------------------------------------------------------------ 1. live ext4 under fsync load

serial('fork of a live ext4 volume under an fsync loop: the fork mounts (journal replay), passes e2fsck, has every file fsync\'d before the fork; then both diverge', async (t) => {
  const SIZE = 256 * MiB;
  const store = newStore(t);
  // Short idle grace, and wait for the lease: the last step reattaches each volume through
  // the other server, which must wait until the first one has closed it.
  const opts = ['--idle-grace', '0.2', '--on-held', 'wait', '--held-wait', '20'];
  const A = await serverOn(t, store, opts, [{ name: 'live', size: SIZE }]);
  const B = await serverOn(t, store, opts);
  const mntA = tempDir(t, 'baton-fork-mnt-');
  const mntF = tempDir(t, 'baton-fork-mnt-');

  const pa = await attach(t, A, 'live', SIZE);
  await runOk('mkfs.ext4', ['-q', '-F', '-E', 'lazy_itable_init=0,lazy_journal_init=0', pa.loop.dev], { timeoutMs: 60_000 });
  const ma = await mountExt4(t, pa.loop.dev, mntA);
  const DIRS = 6;
  for (let d = 0; d < DIRS; d++) await fsp.mkdir(path.join(mntA, `d${d}`));
  await syncDir(mntA);

  // The load: new files, each fsync'd (file, then its directory) before it counts as durable;
  // every 4th iteration an atomic replace of state.txt (tmp + fsync + rename + fsync dir).
  const durable = new Map<string, string>();
  let stateStarted = 0;
  let stateDurable = 0;
  let stop = false;
  const writer = (async () => {
    for (let i = 0; !stop; i++) {
      const dir = `d${i % DIRS}`;
      const rel = path.join(dir, `f${i}.bin`);
      const data = randomBytes(512 + ((i * 7919) % 48_000));
      await writeFileSynced(path.join(mntA, rel), data);
      await syncDir(path.join(mntA, dir));
      durable.set(rel, sha256(data));
      if (i % 4 === 3) {
        const v = ++stateStarted;
        await writeFileSynced(path.join(mntA, 'state.tmp'), `state ${v} ${'x'.repeat(v % 300)}\n`);
        await fsp.rename(path.join(mntA, 'state.tmp'), path.join(mntA, 'state.txt'));
        await syncDir(mntA);
        stateDurable = v;
      }
    }
  })();
  writer.catch(() => { stop = true; });

  while (durable.size < 40 && !stop) await new Promise((r) => setTimeout(r, 20));
  // Everything acknowledged as durable before `baton fork` starts must be in the fork.
  const before = new Map(durable);
  const stateBefore = stateDurable;
  const t0 = performance.now();
  const fork = await cliJson<VolJson & { ms: number }>(['fork', 'live', 'live-fork', '--store', store]);
  const forkWall = performance.now() - t0;
  const stateStartedAtForkEnd = stateStarted;
  const duringFork = durable.size - before.size;
  await new Promise((r) => setTimeout(r, 700)); // the parent keeps writing after the fork
  stop = true;
  await writer;
  t.log(`fork under load at log record ${fork.parent?.seq}: ${fork.ms} ms in baton, ${forkWall.toFixed(0)} ms for the process; ${before.size} files durable before, ${duringFork} during, ${durable.size} in all`);
  t.is(fork.parent?.seq !== undefined && fork.parent.seq > 0, true, 'the fork points at a log position of the live parent');

  // ---- the fork, served by another server process
  const pf = await attach(t, B, 'live-fork', SIZE);
  const sb = await runOk('dumpe2fs', ['-h', pf.loop.dev], { timeoutMs: 30_000 });
  t.regex(sb.stdout, /^Filesystem features:.*needs_recovery/m, 'the fork is a crash image of a mounted ext4: its journal needs replay');
  let mf = await mountExt4(t, pf.loop.dev, mntF); // read-write: the journal replays
  let present = 0;
  for (const [rel, hash] of before) {
    const h = await fileHash(path.join(mntF, rel));
    if (h === hash) present++;
    else t.fail(`${rel}, fsync'd before the fork, is ${h === null ? 'missing' : 'different'} in the fork`);
  }
  t.is(present, before.size);
  const later = [...durable.keys()].filter((k) => !before.has(k));
  const laterPresent = (await Promise.all(later.map((rel) => fileHash(path.join(mntF, rel))))).filter((h) => h !== null).length;
  t.log(`fork has all ${before.size} files fsync'd before it, and ${laterPresent} of the ${later.length} written later`);
  const state = await fsp.readFile(path.join(mntF, 'state.txt'), 'utf8').catch(() => null);
  if (stateBefore > 0) {
    t.truthy(state, 'state.txt exists in the fork');
    const m = /^state (\d+) (x*)\n$/.exec(state ?? '');
    t.truthy(m, `state.txt is whole: ${JSON.stringify(state?.slice(0, 60))}`);
    const v = Number(m?.[1]);
    t.true(v >= stateBefore && v <= stateStartedAtForkEnd, `state.txt version ${v}: durable before the fork ${stateBefore}, started by its end ${stateStartedAtForkEnd}`);
    t.is(m?.[2]?.length, v % 300);
  }
  await mf.unmount();
  await e2fsckClean(t, pf.loop.dev, 'the fork after journal replay');

  // ---- divergence: the same path gets different contents, and each side a file of its own
  const shared = [...before.keys()][0]!;
  const parentData = randomBytes(3 * MiB + 123);
  const forkData = randomBytes(2 * MiB + 77);
  mf = await mountExt4(t, pf.loop.dev, mntF);
  await writeFileSynced(path.join(mntF, shared), forkData);
  await writeFileSynced(path.join(mntF, 'fork-only.bin'), forkData);
  await syncDir(mntF);
  await writeFileSynced(path.join(mntA, shared), parentData);
  await writeFileSynced(path.join(mntA, 'parent-only.bin'), parentData);
  await syncDir(mntA);
  await detach(pf, mf);
  await detach(pa, ma);

  const diff = await cliJson<DiffJson>(['diff', 'live', 'live-fork', '--store', store]);
  t.true(diff.differentBytes > 0, 'parent and fork differ');
  t.true(diff.differentBytes < SIZE / 2, `they still share most data (${diff.differentBytes} bytes differ)`);

  // ---- fresh nbdfuse + loop stacks (no page cache from before), on the other server each
  const checks: [BatonServer, string, Buffer, string, string][] = [
    [B, 'live', parentData, 'parent-only.bin', 'fork-only.bin'],
    [A, 'live-fork', forkData, 'fork-only.bin', 'parent-only.bin'],
  ];
  for (const [server, name, mine, own, foreign] of checks) {
    const s = await attach(t, server, name, SIZE);
    await e2fsckClean(t, s.loop.dev, name);
    const m = await mountWith(t, s.loop.dev, mntF, 'ro');
    t.is(await fileHash(path.join(mntF, shared)), sha256(mine), `${name}: ${shared} has its own contents`);
    t.is(await fileHash(path.join(mntF, own)), sha256(mine), `${name}: ${own}`);
    t.is(await fileHash(path.join(mntF, foreign)), null, `${name} never sees ${foreign}`);
    let intact = 0;
    for (const [rel, hash] of before) if (rel === shared || (await fileHash(path.join(mntF, rel))) === hash) intact++;
    t.is(intact, before.size, `${name}: the other pre-fork files are intact`);
    await detach(s, m);
  }
  await A.stop();
  await B.stop();
  t.is(A.proc.exitCode, 0, A.stderr());
  t.is(B.proc.exitCode, 0, B.stderr());
});

// ------------------------------------------------------------------ 2. git workspace, three forks

async function git(cwd: string, args: string[], timeoutMs = 120_000): Promise<RunResult> {
  return runOk('git', [...GIT, '-C', cwd, ...args], { timeoutMs });
}

async function gitVerify(t: ExecutionContext, dir: string, head: string, subjects: string[], what: string): Promise<void> {
  const fsck = await run('git', [...GIT, '-C', dir, 'fsck', '--full', '--strict'], { timeoutMs: 120_000 });
  t.is(fsck.code, 0, `${what}: ${fsck.output}`);
  t.notRegex(fsck.stdout + fsck.stderr, /error|missing|corrupt|broken|dangling/i, `${what}: ${fsck.output}`);
  const log = await git(dir, ['log', '--format=%H %s']);
  const lines = log.stdout.trim().split('\n');
  t.is(lines[0]?.split(' ')[0], head, `${what}: HEAD`);
  t.deepEqual(lines.map((l) => l.slice(41)), subjects, `${what}: git log`);
  t.is((await git(dir, ['status', '--porcelain'])).stdout, '', `${what}: work tree matches its commit`);
}

serial('three forks of a git workspace: own commits, git fsck on all four, diff and space accounting, rm of two leaves the others whole', async (t) => {
  const SIZE = 256 * MiB;
  // Every process on this store, like gcUntilQuiet's, runs with GC_TEST_ENV: the store records
  // BATON_MAX_OPERATION_MS and refuses a mix (serial test: nothing else runs meanwhile).
  process.env.BATON_MAX_OPERATION_MS = GC_TEST_ENV.BATON_MAX_OPERATION_MS;
  t.teardown(() => { delete process.env.BATON_MAX_OPERATION_MS; });
  const store = newStore(t);
  const A = await serverOn(t, store, ['--idle-grace', '0.2'], [{ name: 'ws', size: SIZE }]);
  const mnt = tempDir(t, 'baton-fork-mnt-');
  const FORKS = ['w1', 'w2', 'w3'];

  // ---- the workspace: a repository of 300 files and one commit, plus a node_modules tree
  let s = await attach(t, A, 'ws', SIZE);
  await runOk('mkfs.ext4', ['-q', '-F', s.loop.dev], { timeoutMs: 60_000 });
  let m = await mountExt4(t, s.loop.dev, mnt);
  for (let d = 0; d < 10; d++) {
    await fsp.mkdir(path.join(mnt, 'src', `mod${d}`), { recursive: true });
    for (let i = 0; i < 30; i++) {
      const body = `// module ${d}/${i}\n${randomBytes(200 + ((d * 30 + i) * 61) % 4000).toString('base64')}\n`;
      await fsp.writeFile(path.join(mnt, 'src', `mod${d}`, `file${i}.ts`), body);
    }
  }
  for (let p = 0; p < 40; p++) {
    const dir = path.join(mnt, 'node_modules', `pkg-${p}`, 'lib');
    await fsp.mkdir(dir, { recursive: true });
    await fsp.writeFile(path.join(mnt, 'node_modules', `pkg-${p}`, 'package.json'), JSON.stringify({ name: `pkg-${p}`, version: '1.0.0' }));
    for (let i = 0; i < 25; i++) await fsp.writeFile(path.join(dir, `f${i}.js`), `module.exports = ${JSON.stringify(randomBytes(64).toString('hex'))};\n`);
  }
  await fsp.writeFile(path.join(mnt, '.gitignore'), 'node_modules/\n');
  await git(mnt, ['init', '-q']);
  await git(mnt, ['add', '-A']);
  await git(mnt, ['commit', '-q', '-m', 'base']);
  const base = (await git(mnt, ['rev-parse', 'HEAD'])).stdout.trim();
  const nodeModules = await hashTree(path.join(mnt, 'node_modules'));
  t.is(nodeModules.size, 40 * 26);
  await detach(s, m);

  for (const f of FORKS) await cliOk(['fork', 'ws', f, '--store', store]);

  // ---- each fork (and the parent) commits its own change
  const heads = new Map<string, { head: string; subjects: string[]; tree: Map<string, string> }>();
  for (const name of [...FORKS, 'ws']) {
    s = await attach(t, A, name, SIZE);
    m = await mountExt4(t, s.loop.dev, mnt);
    t.is((await git(mnt, ['rev-parse', 'HEAD'])).stdout.trim(), base, `${name} starts at the base commit`);
    await fsp.writeFile(path.join(mnt, 'src', `${name}.txt`), `only in ${name}: ${randomBytes(4000).toString('hex')}\n`);
    await fsp.appendFile(path.join(mnt, 'src', 'mod0', 'file0.ts'), `// changed in ${name}\n`);
    await fsp.rm(path.join(mnt, 'src', 'mod1', `file${FORKS.indexOf(name) + 1}.ts`));
    await git(mnt, ['add', '-A']);
    await git(mnt, ['commit', '-q', '-m', `work in ${name}`]);
    const head = (await git(mnt, ['rev-parse', 'HEAD'])).stdout.trim();
    heads.set(name, { head, subjects: [`work in ${name}`, 'base'], tree: await hashTree(mnt) });
    await gitVerify(t, mnt, head, [`work in ${name}`, 'base'], name);
    await detach(s, m);
  }
  t.is(new Set([...heads.values()].map((h) => h.head)).size, 4, 'four different commits');

  // ---- diff from the maps, checked against the bytes
  const d12 = await cliJson<DiffJson>(['diff', 'w1', 'w2', '--store', store]);
  const d1p = await cliJson<DiffJson>(['diff', 'w1', 'ws', '--store', store]);
  const ls = await cliJson<VolJson[]>(['ls', '--store', store]);
  const byName = new Map(ls.map((v) => [v.name, v]));
  t.true(d12.differentBytes > 0 && d12.ranges.length > 0, 'two forks differ');
  t.true(d1p.differentBytes > 0, 'a fork and its parent differ');
  const parentWritten = byName.get('ws')?.writtenBytes ?? 0;
  t.true(d1p.differentBytes < parentWritten / 2, `fork vs parent: ${d1p.differentBytes} bytes differ of ${parentWritten} written (a small subset)`);
  const imgDir = tempDir(t, 'baton-fork-img-');
  for (const name of ['w1', 'w2', 'ws']) await copyOut(A, name, path.join(imgDir, name));
  const real12 = await checkDiffCovers(t, path.join(imgDir, 'w1'), path.join(imgDir, 'w2'), d12.ranges, 'diff w1 w2');
  const real1p = await checkDiffCovers(t, path.join(imgDir, 'w1'), path.join(imgDir, 'ws'), d1p.ranges, 'diff w1 ws');
  t.log(`diff w1 w2: ${d12.ranges.length} ranges, ${d12.differentBytes} bytes (${real12} really differ); diff w1 ws: ${d1p.differentBytes} bytes (${real1p} really differ)`);

  // ---- space accounting
  for (const name of [...FORKS, 'ws']) {
    const v = byName.get(name);
    t.truthy(v, `${name} in baton ls`);
    t.true((v?.sharedBytes ?? 0) > 0, `${name}: sharedBytes ${v?.sharedBytes} > 0`);
    t.true((v?.writtenBytes ?? 0) > 0, `${name}: writtenBytes`);
    t.is((v?.exclusiveBytes ?? 0) + (v?.sharedBytes ?? 0), v?.writtenBytes ?? -1, `${name}: exclusive + shared = written`);
    if (name !== 'ws') t.true((v?.exclusiveBytes ?? Infinity) < (v?.writtenBytes ?? 0) / 2, `${name}: exclusive ${v?.exclusiveBytes} well below written ${v?.writtenBytes}`);
  }
  t.log(ls.map((v) => `${v.name}: written ${v.writtenBytes}, exclusive ${v.exclusiveBytes}, shared ${v.sharedBytes}`).join('; '));

  // ---- rm two forks, GC; their exclusive bytes are gone; the survivor and the parent still verify
  const bytesBefore = await storeObjectBytes(store);
  // In stored bytes (the data is compressed): what accounting says those bytes cost in the store.
  const dropped = (byName.get('w2')?.exclusiveStoredBytes ?? 0) + (byName.get('w3')?.exclusiveStoredBytes ?? 0);
  t.true(dropped > 0 && dropped <= (byName.get('w2')?.exclusiveBytes ?? 0) + (byName.get('w3')?.exclusiveBytes ?? 0), `exclusive stored bytes ${dropped}: at most the logical ones`);
  for (const name of ['w2', 'w3']) {
    const r = await cliOk(['rm', name, '--store', store]);
    t.regex(r.stdout, new RegExp(`^removed ${name}\\n$`), 'a leaf fork is removed with its data');
  }
  t.deepEqual((await cliJson<VolJson[]>(['ls', '--store', store])).map((v) => v.name).sort(), ['w1', 'ws']);
  await A.stop();
  const gcRuns = await gcUntilQuiet(store);
  const bytesAfter = await storeObjectBytes(store);
  t.log(`store: ${bytesBefore} bytes before rm, ${bytesAfter} after rm + gc (${gcRuns.map((r) => `deleted ${r.deletedObjects}`).join(', ')}); w2+w3 exclusive ${dropped}`);
  t.true(bytesBefore - bytesAfter >= dropped, `the removed forks' ${dropped} exclusive bytes are gone (${bytesBefore} -> ${bytesAfter})`);
  const A2 = await serverOn(t, store); // a new process: nothing cached in memory
  for (const name of ['w1', 'ws']) {
    s = await attach(t, A2, name, SIZE);
    await e2fsckClean(t, s.loop.dev, name);
    m = await mountWith(t, s.loop.dev, mnt, 'ro');
    const h = heads.get(name)!;
    await gitVerify(t, mnt, h.head, h.subjects, `${name} after rm of w2 and w3`);
    t.deepEqual(await hashTree(mnt), h.tree, `${name}: every file as committed (and node_modules)`);
    await detach(s, m);
  }
  const d1pAfter = await cliJson<DiffJson>(['diff', 'w1', 'ws', '--store', store]);
  t.deepEqual(d1pAfter.ranges, d1p.ranges, 'the diff of the survivors is unchanged by the removals');
  await A2.stop();
  t.is(A2.proc.exitCode, 0, A2.stderr());
});

// ------------------------------------------------------------------ 3. snapshots

withQemu('snapshot: read-only over NBD (flag, EPERM, qemu-io refused), old content, exact diff, forkable; removing the parent keeps what they map', async (t) => {
  const SIZE = 64 * MiB;
  const store = newStore(t);
  const A = await serverOn(t, store, ['--idle-grace', '0.2'], [{ name: 'sv', size: SIZE }]);
  const uri = (n: string): string => A.uri(n);

  await qemuIoOk(t, uri('sv'), ['write -P 0xa1 0 1M', 'write -P 0xa2 8M 64k', 'flush']);
  const snap = await cliJson<VolJson>(['snapshot', 'sv', 's1', '--store', store]);
  t.is(snap.name, 'sv@s1');
  t.is(snap.kind, 'snapshot');
  await qemuIoOk(t, uri('sv'), ['write -P 0xb1 0 4k', 'write -z 8M 64k', 'write -P 0xb2 16M 1M', 'flush']);

  // read-only: nbdinfo, qemu-io, and a WRITE on the wire
  const info = JSON.parse((await runOk('nbdinfo', ['--json', uri('sv@s1')])).stdout) as { exports: { is_read_only: boolean; 'export-size': number }[] };
  t.true(info.exports[0]?.is_read_only, 'nbdinfo: the snapshot is read-only');
  t.is(info.exports[0]?.['export-size'], SIZE);
  const infoRw = JSON.parse((await runOk('nbdinfo', ['--json', uri('sv')])).stdout) as { exports: { is_read_only: boolean }[] };
  t.false(infoRw.exports[0]?.is_read_only, 'nbdinfo: the volume itself is writable');
  const qw = await qemuIo(uri('sv@s1'), ['write -P 0xcc 0 4k', 'flush']);
  t.not(qw.code, 0, qw.output);
  t.regex(qw.output, /Permission denied|read-only/i);
  {
    const { client, eflags } = await connectGo(A.socket, 'sv@s1');
    try {
      t.truthy(eflags & TFLAG.READ_ONLY, 'READ_ONLY transmission flag');
      const w = await client.writeAt(1n, 0n, Buffer.alloc(4096, 0xcc));
      t.is(w.magic, SIMPLE_REPLY_MAGIC);
      t.is(w.error, ERRNO.EPERM, 'a WRITE to the snapshot gets EPERM');
      await client.write(requestFrame({ type: CMD.WRITE_ZEROES, cookie: 2n, offset: 0n, length: 4096 }));
      t.is((await client.simpleReply()).error, ERRNO.EPERM, 'WRITE_ZEROES too');
      await client.write(requestFrame({ type: CMD.TRIM, cookie: 3n, offset: 0n, length: 4096 }));
      t.is((await client.simpleReply()).error, ERRNO.EPERM, 'TRIM too');
      const r = await client.readAt(4n, 0n, 4096);
      t.true(r.data?.equals(Buffer.alloc(4096, 0xa1)), 'and the refused writes left nothing behind');
      await client.disconnect();
    } finally {
      client.destroy();
    }
  }

  // old content in the snapshot, new in the volume
  await qemuIoOk(t, uri('sv@s1'), ['read -P 0xa1 0 1M', 'read -P 0xa2 8M 64k', 'read -P 0 16M 1M'], true);
  await qemuIoOk(t, uri('sv'), ['read -P 0xb1 0 4k', 'read -P 0xa1 4k 1020k', 'read -P 0 8M 64k', 'read -P 0xb2 16M 1M'], true);

  // diff: exactly what changed after the snapshot
  const d = await cliJson<DiffJson>(['diff', 'sv@s1', 'sv', '--store', store]);
  t.deepEqual(d.ranges, [{ offset: 0, length: 4096 }, { offset: 8 * MiB, length: 64 * 1024 }, { offset: 16 * MiB, length: MiB }]);

  // fork of the snapshot: writable, starts with the old content
  const again = await cli(['snapshot', 'sv', 's1', '--store', store]);
  t.is(again.code, 1);
  t.regex(again.stderr, /already exists/);
  const back = await cliJson<VolJson>(['fork', 'sv@s1', 'back', '--store', store]);
  t.is(back.kind, 'volume');
  t.deepEqual(back.parent, snap.parent, 'a fork of a snapshot starts at the snapshot\'s point');
  await qemuIoOk(t, uri('back'), ['read -P 0xa1 0 1M', 'read -P 0xa2 8M 64k', 'read -P 0 16M 1M', 'write -P 0xc1 0 4k', 'flush', 'read -P 0xc1 0 4k']);
  await qemuIoOk(t, uri('sv@s1'), ['read -P 0xa1 0 1M'], true);
  await qemuIoOk(t, uri('sv'), ['read -P 0xb1 0 4k'], true);
  t.deepEqual((await cliJson<DiffJson>(['diff', 'sv@s1', 'back', '--store', store])).ranges, [{ offset: 0, length: 4096 }]);

  // nothing unflushed: a write the server acknowledged but no FLUSH covered is in neither a
  // fork nor a snapshot made meanwhile (and still not after the parent flushes it)
  {
    const { client } = await connectGo(A.socket, 'sv');
    try {
      t.is((await client.writeAt(1n, BigInt(32 * MiB), Buffer.alloc(4096, 0xe1))).error, 0);
      await cliOk(['fork', 'sv', 'unflushed', '--store', store]);
      await cliOk(['snapshot', 'sv', 's2', '--store', store]);
      t.is((await client.command({ type: CMD.FLUSH, cookie: 2n, offset: 0n, length: 0 })).error, 0);
      await client.disconnect();
    } finally {
      client.destroy();
    }
    await qemuIoOk(t, uri('sv'), ['read -P 0xe1 32M 4k'], true);
    await qemuIoOk(t, uri('unflushed'), ['read -P 0 32M 4k', 'read -P 0xb1 0 4k'], true);
    await qemuIoOk(t, uri('sv@s2'), ['read -P 0 32M 4k', 'read -P 0xb2 16M 1M'], true);
    t.regex((await rmOnceReleased('unflushed', store)).stdout, /^removed unflushed\n$/);
    t.regex((await rmOnceReleased('sv@s2', store)).stdout, /^removed sv@s2\n$/);
  }

  // the CLI's answers to wrong input
  const bad: [string[], number, RegExp][] = [
    [['fork', 'sv', 'x@y'], 2, /invalid volume name "x@y"/],
    [['fork', 'nope', 'x'], 1, /no volume "nope"/],
    [['fork', 'sv', 'back'], 1, /already exists/],
    [['fork', 'sv@nope', 'x'], 1, /no volume "sv@nope"/],
    [['snapshot', 'sv@s1', 's3'], 2, /invalid volume name/],
    [['snapshot', 'sv', 'bad/name'], 2, /invalid snapshot name/],
    [['diff', 'sv', 'nope'], 1, /no volume "nope"/],
  ];
  for (const [args, code, re] of bad) {
    const r = await cli([...args, '--store', store]);
    t.is(r.code, code, `baton ${args.join(' ')}: ${r.output}`);
    t.regex(r.stderr, re, `baton ${args.join(' ')}`);
    t.notRegex(r.stderr, /\n\s+at /, 'no stack trace');
  }
  for (const cmd of ['fork', 'snapshot', 'diff']) t.regex((await cliOk([cmd, '--help'])).stdout, /Examples:\n\s+\$ baton /, `baton ${cmd} --help`);

  // remove the parent: refused while it has a snapshot (a snapshot belongs to its volume);
  // with --snapshots both go, and the forks keep what they map (checked by a new process)
  await A.stop();
  t.is(A.proc.exitCode, 0, A.stderr());
  const refused = await cli(['rm', 'sv', '--store', store]);
  t.is(refused.code, 2, refused.output);
  t.regex(refused.stderr, /volume sv has 1 snapshot: sv@s1; .*baton rm sv --snapshots/);
  const back2 = await cliJson<VolJson>(['fork', 'sv@s1', 'back2', '--store', store]);
  t.deepEqual(back2.parent, snap.parent);
  const B = await serverOn(t, store, ['--idle-grace', '0.2']);
  await qemuIoOk(t, B.uri('sv@s1'), ['read -P 0xa1 0 1M', 'read -P 0xa2 8M 64k', 'read -P 0 16M 1M'], true);
  await qemuIoOk(t, B.uri('back2'), ['read -P 0xa1 0 1M', 'read -P 0xa2 8M 64k', 'write -P 0xd1 0 4k', 'flush']);
  const rm = await cliOk(['rm', 'sv', '--snapshots', '--store', store]);
  t.regex(rm.stdout, /^removed snapshot sv@s1\nremoved sv; its data stays in the store because forks or snapshots still use it\n$/);
  await new Promise((r) => setTimeout(r, 400)); // idle grace: let B close back2 so the next open reads the store
  await qemuIoOk(t, B.uri('back'), ['read -P 0xc1 0 4k', 'read -P 0xa1 4k 1020k', 'read -P 0xa2 8M 64k'], true);
  await qemuIoOk(t, B.uri('back2'), ['read -P 0xd1 0 4k', 'read -P 0xa1 4k 1020k', 'read -P 0xa2 8M 64k'], true);
  const names = (await cliJson<VolJson[]>(['ls', '--store', store])).map((v) => v.name).sort();
  t.deepEqual(names, ['back', 'back2']);
  await B.stop();
  t.is(B.proc.exitCode, 0, B.stderr());
});

// ------------------------------------------------------------------ 4. 50 generations deep

interface FioLat { meanUs: number; p50Us: number; p99Us: number; iops: number }

async function fioRandread(uri: string, size: number, runtime: number, dir: string): Promise<FioLat> {
  const out = path.join(dir, `fio-${process.hrtime.bigint()}.json`);
  await runOk('fio', ['--name=randread', '--ioengine=nbd', `--uri=${uri}`, '--rw=randread', '--bs=4k', '--iodepth=1', '--direct=1',
    '--time_based', `--runtime=${runtime}`, `--size=${size}`, '--lat_percentiles=1', '--output-format=json', `--output=${out}`], { timeoutMs: (runtime + 60) * 1000 });
  const text = await fsp.readFile(out, 'utf8');
  const job = (JSON.parse(text.slice(text.indexOf('{'))) as { jobs: { read: { iops: number; lat_ns: { mean: number; percentile: Record<string, number> } } }[] }).jobs[0]!;
  const lat = job.read.lat_ns;
  return { meanUs: lat.mean / 1000, p50Us: (lat.percentile['50.000000'] ?? NaN) / 1000, p99Us: (lat.percentile['99.000000'] ?? NaN) / 1000, iops: job.read.iops };
}

withFio('a chain 50 forks deep, each generation served and written: every read is right (fio latency deepest vs root is logged)', async (t) => {
  const SIZE = 64 * MiB;
  const BASE = 16 * MiB;
  const DEPTH = 50;
  const GEN_STRIDE = 64 * 1024;
  const store = newStore(t);
  const A = await serverOn(t, store, ['--idle-grace', '0.2'], [{ name: 'g0', size: SIZE }]);
  const dir = tempDir(t, 'baton-fork-chain-');

  // The root: 16 MiB of random data; every generation then writes 4 KiB inside it.
  const base = randomBytes(BASE);
  await fsp.writeFile(path.join(dir, 'base'), base);
  await runOk('nbdcopy', ['--flush', path.join(dir, 'base'), A.uri('g0')], { timeoutMs: 60_000 });
  const catalog = openStoreCatalog(store, { cacheDir: tempDir(t, 'baton-fork-cache-') });
  const t0 = performance.now();
  const forkMs: number[] = [];
  for (let g = 1; g <= DEPTH; g++) {
    const f0 = performance.now();
    const v = await catalog.fork(`g${g - 1}`, `g${g}`);
    forkMs.push(performance.now() - f0);
    t.truthy(v.parent);
    await qemuIoOk(t, A.uri(`g${g}`), [`write -P ${g} ${g * GEN_STRIDE} 4k`, 'flush']);
  }
  t.log(`50 generations in ${((performance.now() - t0) / 1000).toFixed(1)} s; in-process fork median ${[...forkMs].sort((a, b) => a - b)[25]!.toFixed(1)} ms`);

  const expected = (gen: number): Buffer => {
    const b = Buffer.concat([base, Buffer.alloc(SIZE - BASE)]);
    for (let g = 1; g <= gen; g++) b.fill(g, g * GEN_STRIDE, g * GEN_STRIDE + 4096);
    return b;
  };
  for (const g of [0, 1, 25, DEPTH]) {
    const file = path.join(dir, `g${g}.img`);
    await copyOut(A, `g${g}`, file);
    const got = await fsp.readFile(file);
    const want = expected(g);
    let at = 0;
    while (at < Math.min(got.length, want.length) && got[at] === want[at]) at++;
    t.is(at, want.length, `g${g} differs from what its ancestry wrote, first at byte ${at} (generation block ${Math.floor(at / GEN_STRIDE)})`);
    t.is(got.length, want.length);
    await fsp.rm(file);
  }

  // Latency: warm both (same objects, same cache), then fio QD1 4k randread over the data.
  await fioRandread(A.uri('g0'), BASE, 1, dir);
  await fioRandread(A.uri(`g${DEPTH}`), BASE, 1, dir);
  const root = await fioRandread(A.uri('g0'), BASE, 5, dir);
  const deep = await fioRandread(A.uri(`g${DEPTH}`), BASE, 5, dir);
  t.log(`fio randread 4k QD1, 5 s: root p50 ${root.p50Us.toFixed(0)} µs mean ${root.meanUs.toFixed(0)} µs (${root.iops.toFixed(0)} IOPS); ` +
    `50 deep p50 ${deep.p50Us.toFixed(0)} µs mean ${deep.meanUs.toFixed(0)} µs (${deep.iops.toFixed(0)} IOPS); ratio p50 ${(deep.p50Us / root.p50Us).toFixed(2)}, mean ${(deep.meanUs / root.meanUs).toFixed(2)}`);
  await A.stop();
  t.is(A.proc.exitCode, 0, A.stderr());
});

// ------------------------------------------------------------------ 5. block level: the exact fork point

/** A model that also records, per block, the generations sent while `recording` is on. */
class RecordingModel extends BlockModel {
  recording = false;
  readonly sentWhileRecording = new Map<number, number[]>();
  override writeSent(start: number, count: number, gen: number): void {
    super.writeSent(start, count, gen);
    if (!this.recording) return;
    for (let b = start; b < start + count; b++) {
      const l = this.sentWhileRecording.get(b);
      if (l) l.push(gen); else this.sentWhileRecording.set(b, [gen]);
    }
  }
}

test('block level: a fork made under write load holds every write a FLUSH acknowledged before the fork, nothing never sent, and diverges cleanly', async (t) => {
  const BLOCKS = 4096; // 16 MiB
  const store = newStore(t);
  const A = await serverOn(t, store, ['--idle-grace', '0.2'], [{ name: 'blk', size: 32 * MiB }]);
  const salt = 0x5eed0000 + (Date.now() & 0xffff);
  const model = new RecordingModel(BLOCKS, salt);

  // 70 small commits first, past the model's blocks, so the parent has a checkpoint (every
  // 64 log records) and the fork starts from checkpoint + log, not from the log alone.
  {
    const { client } = await connectGo(A.socket, 'blk');
    try {
      for (let i = 0; i < 70; i++) {
        t.is((await client.writeAt(BigInt(2 * i + 1), BigInt(BLOCKS * BLOCK + i * BLOCK), Buffer.alloc(BLOCK, i + 1))).error, 0);
        t.is((await client.command({ type: CMD.FLUSH, cookie: BigInt(2 * i + 2), offset: 0n, length: 0 })).error, 0);
      }
      await client.disconnect();
    } finally {
      client.destroy();
    }
  }

  let forkDone: Promise<void> | null = null;
  let ackedAtFork: Uint32Array | null = null;
  let pendingAtFork: (number[] | undefined)[] = [];
  let flushesBefore = 0;
  let forkResult: RunResult | null = null;
  const stats = await runWriter(A.socket, model, {
    exportName: 'blk', rng: rngFrom(salt), flushEvery: 6, depth: 6, connections: 2, hotBlocks: 256, durationMs: 4000, finalFlushTries: 3,
    onEvent: (e, s) => {
      // Once some flushes are acknowledged, take the model's state and start the fork
      // (synchronously, between two replies): what is acknowledged now must be in the fork.
      if (forkDone || e.type !== 'flush-done' || s.flushesOk < 10) return;
      ackedAtFork = model.acked.slice();
      pendingAtFork = model.pending.map((p) => p?.slice());
      flushesBefore = s.flushesOk;
      model.recording = true;
      forkDone = cli(['fork', 'blk', 'blk-fork', '--store', store]).then((r) => { forkResult = r; model.recording = false; });
    },
  });
  t.truthy(forkDone, 'the fork was started');
  await forkDone;
  t.is(forkResult!.code, 0, forkResult!.output);
  const forkInfo = await cliJson<VolJson>(['info', 'blk-fork', '--store', store]);
  t.true((forkInfo.parent?.seq ?? 0) > 71, `the fork point (log record ${forkInfo.parent?.seq}) is past the parent's first checkpoint`);
  t.is(stats.endedBy, 'done');
  t.is(stats.flushesFailed, 0);
  t.true(model.allRepliedCovered, 'the final flush covered everything');
  t.log(`writer: ${stats.writesSent} writes, ${stats.flushesOk} flushes (${flushesBefore} before the fork); ${[...model.sentWhileRecording.keys()].length} blocks written while the fork ran`);

  // The parent: exactly the model.
  const vp = await verifyVolume(A.socket, 'blk', model);
  t.is(vp.problemCount, 0, `parent: ${describeProblems(vp)}`);

  // The fork: at least what was acknowledged at its start, at most what was sent by its end.
  const forkModel = new BlockModel(BLOCKS, salt);
  forkModel.acked.set(ackedAtFork!);
  for (let b = 0; b < BLOCKS; b++) {
    const allowed = new Set([...(pendingAtFork[b] ?? []), ...(model.sentWhileRecording.get(b) ?? [])]);
    forkModel.pending[b] = allowed.size > 0 ? [...allowed].sort((x, y) => x - y) : undefined;
  }
  const vf = await verifyVolume(A.socket, 'blk-fork', forkModel);
  {
    const { client } = await connectGo(A.socket, 'blk-fork');
    const r = await client.readAt(1n, BigInt(BLOCKS * BLOCK), 70 * BLOCK);
    const want = Buffer.concat(Array.from({ length: 70 }, (_, i) => Buffer.alloc(BLOCK, i + 1)));
    t.true(r.data?.equals(want), 'the fork has the 70 commits made before the writer');
    await client.disconnect();
    client.destroy();
  }
  t.is(vf.problemCount, 0, `fork: ${describeProblems(vf)}`);
  t.log(`fork: ${vf.atAcked} blocks at the generation acknowledged when the fork started, ${vf.newer} at a later one (flushed while it ran)`);
  t.true(vf.atAcked + vf.newer === BLOCKS);

  // Diverge: the fork gets its own writes (generations from 10^6 on); the parent must never show them.
  forkModel.rebase(vf.observed);
  forkModel.nextGen = 1_000_000;
  const fstats = await runWriter(A.socket, forkModel, { exportName: 'blk-fork', rng: rngFrom(salt + 1), flushEvery: 8, depth: 4, durationMs: 1500, finalFlushTries: 3 });
  t.is(fstats.flushesFailed, 0);
  t.true(fstats.writesOk > 0);
  const vf2 = await verifyVolume(A.socket, 'blk-fork', forkModel);
  t.is(vf2.problemCount, 0, `fork after its own writes: ${describeProblems(vf2)}`);
  const vp2 = await verifyVolume(A.socket, 'blk', model);
  t.is(vp2.problemCount, 0, `parent after the fork's writes: ${describeProblems(vp2)}`);
  await A.stop();
  t.is(A.proc.exitCode, 0, A.stderr());
});

// ------------------------------------------------------------------ 6. rm racing fork

/** A store whose put of one key waits for a gate: puts the moment of a race where we want it. */
class GatedStore implements ObjectStore {
  readonly description: string;
  gateKey: string | null = null;
  reached!: Promise<void>;
  private onReached!: () => void;
  private release!: () => void;
  private gate!: Promise<void>;
  constructor(readonly next: ObjectStore) {
    this.description = next.description;
    this.arm(null);
  }
  arm(key: string | null): void {
    this.gateKey = key;
    this.reached = new Promise((r) => { this.onReached = r; });
    this.gate = new Promise((r) => { this.release = r; });
  }
  open(): void { this.release(); }
  get: ObjectStore['get'] = (key, range) => this.next.get(key, range);
  head: ObjectStore['head'] = (key) => this.next.head(key);
  list: ObjectStore['list'] = (prefix, options) => this.next.list(prefix, options);
  delete: ObjectStore['delete'] = (key) => this.next.delete(key);
  close: ObjectStore['close'] = () => this.next.close();
  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    if (key === this.gateKey) { this.onReached(); await this.gate; }
    return this.next.put(key, body, options);
  }
}

// Was a BUG at 123d2e1: `baton rm P` that runs while `baton fork P F` (or `baton snapshot P
// S`) is between reading P's fork point and putting F's record sees no descendant (F's record
// is not there yet), deletes all of P's objects, and both commands report success; F then
// exists but cannot be opened ("its ancestor ... is gone from the store"), and `baton ls` on
// that store fails as a whole (it loads every map). The gate pins down an interleaving that
// two CLI processes can also hit. Correct outcomes, either of which passes: the fork fails
// cleanly and leaves nothing behind, or it succeeds, reads its data, and rm kept P's data.
// The fix (StoreCatalog.confirmSource: write the record, then check the source is still
// there) makes the fork fail cleanly here.
test('rm of a volume racing a fork of it never leaves a fork whose data is gone', async (t) => {
  const dir = tempDir(t, 'baton-fork-race-');
  const gated = new GatedStore(new LocalDirObjectStore(path.join(dir, 'store')));
  const cache = BlockCache.open({ capacityBytes: 16 * MiB });
  const catalog = new StoreCatalog({ store: gated, log: silentLogger(), cache: () => cache });
  for (const op of ['fork', 'snapshot'] as const) {
    const src = `p-${op}`; // a source of its own per round, with data of its own: it gets removed
    await catalog.create(src, 16 * MiB);
    const v = (await catalog.open(src, { readOnly: false })).volume!;
    await v.takeover(1);
    await v.write(0, Buffer.alloc(4096, 0x42), false);
    await v.flush();
    await v.close();
    const dst = op === 'fork' ? `f-${op}` : `${src}@s`;
    gated.arm(`volumes/${dst}`);
    const made = (op === 'fork' ? catalog.fork(src, dst) : catalog.snapshot(src, 's')).then(() => null, (err: unknown) => err as Error);
    await gated.reached; // the new record has its parent point and is about to be named
    const rm = await catalog.remove(src); // a second user, or a second process
    gated.open();
    const err = await made;
    t.log(`${op}: rm keptForRelatives=${rm.keptForRelatives}, deleted ${rm.deletedObjects} objects; ${op} ${err ? `failed: ${err.message}` : 'succeeded'}`);
    const names = (await catalog.list()).map((v) => v.name);
    if (err) {
      t.false(names.includes(dst), `a ${op} that failed leaves no ${dst} behind`);
      continue;
    }
    t.true(names.includes(dst));
    let readBack: Buffer | null = null;
    try {
      const f = (await catalog.open(dst, { readOnly: true })).volume!;
      readBack = await f.read(0, 4096);
      await f.close();
    } catch (e) {
      t.log(`opening ${dst}: ${isBatonError(e) ? `${e.code}: ` : ''}${(e as Error).message}`);
    }
    t.true(readBack?.equals(Buffer.alloc(4096, 0x42)), `${dst}, reported as made, reads its data`);
  }
  const ls = await catalog.listWithAccounting().then(() => 'ok', (err: unknown) => (err as Error).message);
  t.is(ls, 'ok', '`baton ls` still works on this store');
});
