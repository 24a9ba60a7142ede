/**
 * Three forks of the seed's workspace: what forking a real agent workspace costs in time and in
 * store bytes, end to end through the CLI and a real kernel ext4 (nbdfuse + loop, as in
 * test/integration/seed-scenario.test.ts, whose fixtures this reuses: test/helpers/workspace.ts).
 *
 * Per store (`file:`, and radosgw via scripts/rgw.sh when installed):
 *
 *   build     `baton serve`; `baton create ws --size SIZE`; nbdfuse + losetup, mkfs.ext4, mount;
 *             `git clone --no-hardlinks` of the seed's repository (300+ files, 3 commits) and
 *             `npm ci --offline --ignore-scripts` of its npm project (local tarballs; the
 *             registry is a closed loopback port); sync; umount, detach. Store bytes.
 *   fork      `baton fork ws wN --json` for w1..w3: the `ms` baton prints, and the process's
 *             wall time (node start-up included). Store bytes.
 *   work      per fork: nbdfuse + losetup, mount, first `git status` (must be clean); then a
 *             different commit in each (edits, a new binary, deletions), umount + detach.
 *   verify    `git fsck --full --strict` on the three forks and the parent (read-only mounts;
 *             HEAD as expected, work tree clean): any problem fails the bench. Store bytes
 *             (vs 4x the parent's: what four full copies would hold), `baton ls --json`
 *             (written / exclusive / shared per volume) and `baton diff ws wN` (how much of
 *             what a fork changed lies in ext4's journal, located with debugfs after mkfs).
 *   gc        `baton rm w2`, `baton rm w3` (store bytes), stop the server, `baton gc --grace 2s`
 *             until quiet (test/helpers/gc.ts gcUntilQuiet). Store bytes. A new server, empty cache:
 *             attach + mount + `git status` of the survivor w1 (cold), `git fsck --full`,
 *             `npm ls --all`, and `e2fsck -fn` after umount; `git fsck` of the parent again.
 *
 * Every baton process runs with BATON_MAX_OPERATION_MS=1000 (GC's grace of 2 s needs it, and
 * every host must use the same value), its own BATON_HOME and --cache-dir, `--lease-ttl 60`
 * (a loaded machine must not make a server give a lease up mid-run) and `--idle-grace 0.2`.
 *
 * Needs root (losetup, mount), nbdfuse, fusermount3, e2fsprogs, git, npm; exits 0 with
 * a message without them. Knobs: SIZE (1G), RGW (1; 0 skips radosgw), SEED (fixture contents).
 * Results: bench/results/workspace-forks.md and .json.
 */

import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { spawnSync } from 'node:child_process';
import { formatSize } from '../src/size.js';
import { listAll } from '../src/store/object-store.js';
import { openStore } from '../src/store/open.js';
import { attachExport, detachExport, mountExt4, run, runOk, type Mount, type Stack } from '../test/helpers/ext4.js';
import { GC_TEST_ENV, gcUntilQuiet, storeObjectBytes, type GcJson } from '../test/helpers/gc.js';
import { startBatonServer, type BatonServer, type Teardown } from '../test/helpers/server.js';
import { GIT, git, makeNpmProject, makeSourceRepo, npmEnv } from '../test/helpers/workspace.js';
import { rngFrom } from '../test/helpers/writer.js';
import {
  BATON_BIN, MiB, REPO_ROOT, envFlag, envNumber, envSize, fmt, has, machineInfo, makeTempDir, markdownTable, onExitCleanup, runCommand, shellQuote, startRgwBucket,
  writeResults,
} from './lib.js';

const SIZE = envSize('SIZE', '1G');
const SEED = Math.floor(envNumber('SEED', 1)) >>> 0;
const IS_ROOT = process.getuid?.() === 0;
const RGW = envFlag('RGW', true) && IS_ROOT && has('radosgw');
const FORKS = ['w1', 'w2', 'w3'];
const PARENT = 'ws';
const BUCKET = 'bench';
const TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'dumpe2fs', 'debugfs', 'mount', 'umount', 'git', 'npm', 'sync'];

const log = (s: string): void => { process.stderr.write(s + '\n'); };
const commands: { step: string; argv: string[] }[] = [];
const since = (t: number): number => (performance.now() - t) / 1000;

// ------------------------------------------------------------------ teardown (the helpers' `t`)

/**
 * What test/helpers/* register their undo steps with (AVA's `t.teardown`): collected here and
 * run newest first by runAll(), which the scenario calls in `finally` (so also on failure).
 * Every step runs even if an earlier one threw; the errors are returned.
 */
class Teardowns implements Teardown {
  private fns: (() => void | Promise<void>)[] = [];
  teardown(fn: () => void | Promise<void>): void { this.fns.push(fn); }
  async runAll(): Promise<Error[]> {
    const errors: Error[] = [];
    while (this.fns.length > 0) {
      const fn = this.fns.pop()!;
      try { await fn(); } catch (e) { errors.push(e as Error); }
    }
    return errors;
  }
}

/**
 * Last resort at exit (Ctrl-C, a crash of this process): lazily unmount every mount under the
 * run's temp dir (ext4 first, then FUSE), detach loop devices backed by files there, and kill
 * the nbdfuse / baton processes this run started. Normally runAll() has undone all of it.
 */
function installExitUndo(root: string, pids: Set<number>): void {
  onExitCleanup(() => {
    const mounts = (): { dir: string; fstype: string }[] => {
      try {
        return fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n').filter(Boolean).map((l) => {
          const [pre, post] = l.split(' - ');
          return { dir: pre!.split(' ')[4]!, fstype: post?.split(' ')[0] ?? '' };
        }).filter((m) => m.dir.startsWith(root + '/'));
      } catch { return []; }
    };
    for (const m of mounts().filter((x) => !x.fstype.startsWith('fuse'))) spawnSync('umount', ['-l', m.dir], { stdio: 'ignore', timeout: 20_000 });
    const loops = spawnSync('losetup', ['-n', '-O', 'NAME,BACK-FILE', '-l'], { encoding: 'utf8', timeout: 20_000 }).stdout ?? '';
    for (const line of loops.split('\n')) {
      const [dev, file] = line.trim().split(/\s+/, 2);
      if (dev && file?.startsWith(root + '/')) spawnSync('losetup', ['-d', dev], { stdio: 'ignore', timeout: 20_000 });
    }
    for (const m of mounts()) spawnSync('fusermount3', ['-u', '-z', m.dir], { stdio: 'ignore', timeout: 20_000 });
    for (const pid of pids) { try { process.kill(pid, 'SIGKILL'); } catch { /* gone */ } }
  }, 'before');
}

// ------------------------------------------------------------------ a store under test

interface Target {
  label: string;
  /** `--store` URL. */
  store: string;
  /** Environment of every baton process (rgw credentials and endpoint, or nothing). */
  env: Record<string, string>;
  /** Total bytes of every object under vol/ (volume data, logs, checkpoints, metas). */
  objectBytes(): Promise<number>;
}

interface VolJson { name: string; kind: string; size: number; storedBytes?: number; writtenBytes?: number; exclusiveBytes?: number; sharedBytes?: number; parent?: { id: string; seq: number } }

interface AttachTimes { attachS: number; mountS: number; gitStatusS: number; totalS: number }
interface ForkWork extends AttachTimes { name: string; commitS: number; unmountS: number; head: string; changedFiles: number; addedBytes: number }
interface FsckResult { name: string; seconds: number; head: string; ok: boolean; dangling: number; problems: string }

interface TargetResult {
  label: string;
  build: { attachS: number; mkfsS: number; mountS: number; cloneS: number; npmCiS: number; syncS: number; unmountS: number; usedBytes: number; files: number; head: string };
  bytes: { beforeForks: number; afterForks: number; afterCommits: number; afterRm: number; afterGc: number };
  forks: { name: string; reportedMs: number; wallMs: number }[];
  work: ForkWork[];
  fsck: FsckResult[];
  ls: VolJson[];
  /** `baton diff ws wN`: bytes of the fork's map that differ from the parent's. */
  diffs: { name: string; differentBytes: number; ranges: number; inJournal: number }[];
  /** Where ext4's journal (inode 8) lies on the volume, bytes. */
  journal: { offset: number; length: number }[];
  gc: { removed: string[]; runs: GcJson[]; seconds: number; lsAfter: VolJson[] };
  survivor: AttachTimes & { name: string; fsck: FsckResult; npmLsOk: boolean; e2fsckOk: boolean; parentFsck: FsckResult };
  serverExit: string;
}

// ------------------------------------------------------------------ helpers

function env(target: Target): NodeJS.ProcessEnv {
  return { ...process.env, ...target.env };
}

async function batonCli(target: Target, step: string, args: string[]): Promise<{ stdout: string; seconds: number }> {
  const argv = [process.execPath, BATON_BIN, ...args, '--store', target.store];
  commands.push({ step: `${step} (${target.label})`, argv });
  const r = await runCommand(argv, { env: env(target), timeoutMs: 120_000 });
  return { stdout: r.stdout, seconds: r.seconds };
}

async function lsJson(target: Target): Promise<VolJson[]> {
  return JSON.parse((await batonCli(target, 'ls', ['ls', '--json'])).stdout) as VolJson[];
}

/** Until the server logged "volume closed" for each name as often as "volume opened" (idle grace). */
async function waitClosed(server: BatonServer, names: string[], timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const open = new Map<string, number>();
    for (const line of server.stderr().split('\n')) {
      if (!line.includes('volume opened') && !line.includes('volume closed')) continue;
      try {
        const j = JSON.parse(line) as { msg?: string; volume?: string };
        if (!j.volume) continue;
        if (j.msg === 'volume opened') open.set(j.volume, (open.get(j.volume) ?? 0) + 1);
        if (j.msg === 'volume closed') open.set(j.volume, (open.get(j.volume) ?? 0) - 1);
      } catch { /* a partial line */ }
    }
    if (names.every((n) => (open.get(n) ?? 0) <= 0)) return;
    if (Date.now() > deadline) throw new Error(`volumes ${names.join(', ')} not closed by the server within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

interface Mounted { stack: Stack; mount: Mount; dir: string }

/** nbdfuse + losetup, mount (optionally read-only), then the first `git status`: timed. */
async function attachMount(td: Teardowns, server: BatonServer, work: string, name: string, pids: Set<number>, options?: string): Promise<{ m: Mounted; times: AttachTimes }> {
  const t0 = performance.now();
  const stack = await attachExport(td, server.uri(name), fs.mkdtempSync(path.join(work, `fuse-${name}-`)), SIZE);
  if (stack.fuse.proc.pid) pids.add(stack.fuse.proc.pid);
  const attachS = since(t0);
  const dir = fs.mkdtempSync(path.join(work, `mnt-${name}-`));
  const t1 = performance.now();
  const mount = await mountExt4(td, stack.loop.dev, dir, options);
  const mountS = since(t1);
  const t2 = performance.now();
  const status = await git(['-C', path.join(dir, 'repo'), 'status', '--porcelain']);
  const gitStatusS = since(t2);
  if (status !== '') throw new Error(`${name}: git status is not clean after the mount:\n${status}`);
  return { m: { stack, mount, dir }, times: { attachS, mountS, gitStatusS, totalS: since(t0) } };
}

async function fsckRepo(name: string, repo: string, head: string): Promise<FsckResult> {
  const t0 = performance.now();
  const r = await run('git', [...GIT, '-C', repo, 'fsck', '--full', '--strict'], { timeoutMs: 300_000 });
  const seconds = since(t0);
  const got = (await git(['-C', repo, 'rev-parse', 'HEAD'])).trim();
  const status = await git(['-C', repo, 'status', '--porcelain']);
  const text = r.stdout + r.stderr;
  const problems = [
    ...(r.code !== 0 ? [`git fsck exited ${r.code ?? r.signal}`] : []),
    ...text.split('\n').filter((l) => /error|missing|corrupt|broken|bad /i.test(l)),
    ...(got !== head ? [`HEAD is ${got}, want ${head}`] : []),
    ...(status !== '' ? [`work tree not clean: ${status.trim().split('\n').slice(0, 5).join('; ')}`] : []),
  ].join('\n');
  return { name, seconds, head: got, ok: problems === '', dangling: text.split('\n').filter((l) => l.startsWith('dangling')).length, problems };
}

/** The commit fork k (0-based) makes: each its own edits, one new binary, its own deletions. */
async function forkCommit(repo: string, name: string, k: number): Promise<{ changedFiles: number; addedBytes: number }> {
  let changed = 0;
  let added = 0;
  // Edit every text file of one package (pkg3, pkg4, pkg5).
  const srcDir = path.join(repo, `pkg${3 + k}`, 'src');
  for (const f of (await fsp.readdir(srcDir)).sort()) {
    const line = `// edited in ${name}\n`;
    await fsp.appendFile(path.join(srcDir, f), line);
    changed++;
    added += line.length;
  }
  // A new file of notes and a binary of its own size (128, 256, 384 KiB).
  await fsp.mkdir(path.join(repo, 'work'), { recursive: true });
  const notes = `# ${name}\n${'the agent in this fork tried something of its own\n'.repeat(20 * (k + 1))}`;
  await fsp.writeFile(path.join(repo, 'work', `${name}.md`), notes);
  const bin = randomBytes((k + 1) * 128 * 1024);
  await fsp.writeFile(path.join(repo, 'work', `${name}.bin`), bin);
  changed += 2;
  added += notes.length + bin.length;
  // Delete the data files of another package (pkg6, pkg7, pkg8).
  const dataDir = path.join(repo, `pkg${6 + k}`, 'data');
  for (const f of await fsp.readdir(dataDir)) { await fsp.rm(path.join(dataDir, f)); changed++; }
  await git(['-C', repo, 'add', '-A']);
  await git(['-C', repo, 'commit', '-q', '-m', `work in ${name}`]);
  return { changedFiles: changed, addedBytes: added };
}

/** ext4's journal (inode 8) as byte ranges of the device: `debugfs -R 'stat <8>'` extents × the block size. */
async function journalRanges(dev: string): Promise<{ offset: number; length: number }[]> {
  const bs = Number(/Block size:\s+(\d+)/.exec((await runOk('dumpe2fs', ['-h', dev], { timeoutMs: 60_000 })).stdout)?.[1]);
  const stat = (await runOk('debugfs', ['-R', 'stat <8>', dev], { timeoutMs: 60_000 })).stdout;
  const out: { offset: number; length: number }[] = [];
  for (const m of stat.matchAll(/\((\d+)(?:-(\d+))?\):(\d+)(?:-(\d+))?/g)) {
    const first = Number(m[3]);
    const last = m[4] !== undefined ? Number(m[4]) : first;
    out.push({ offset: first * bs, length: (last - first + 1) * bs });
  }
  if (!Number.isFinite(bs) || out.length === 0) throw new Error(`could not find ext4's journal on ${dev}:\n${stat}`);
  return out;
}

/** Bytes of `ranges` inside `within`. */
function overlap(ranges: { offset: number; length: number }[], within: { offset: number; length: number }[]): number {
  let n = 0;
  for (const r of ranges) for (const w of within) n += Math.max(0, Math.min(r.offset + r.length, w.offset + w.length) - Math.max(r.offset, w.offset));
  return n;
}

async function countFiles(root: string): Promise<number> {
  let n = 0;
  const walk = async (d: string): Promise<void> => {
    for (const e of await fsp.readdir(d, { withFileTypes: true })) {
      if (e.name === 'lost+found') continue;
      if (e.isDirectory()) await walk(path.join(d, e.name));
      else n++;
    }
  };
  await walk(root);
  return n;
}

// ------------------------------------------------------------------ the scenario

async function scenario(target: Target, fixtures: { src: string; app: string; work: string; head: string }, root: string, pids: Set<number>): Promise<TargetResult> {
  const td = new Teardowns();
  const dir = fs.mkdtempSync(path.join(root, `${target.label.replace(/[^a-z0-9]/gi, '')}-`));
  const serverArgs = (cache: string): string[] => ['--cache-dir', cache, '--idle-grace', '0.2', '--lease-ttl', '60'];
  const serverEnv = { ...target.env, ...GC_TEST_ENV };
  const start = async (cacheName: string): Promise<BatonServer> => {
    const s = await startBatonServer(td, { store: target.store, env: serverEnv, extraArgs: serverArgs(path.join(dir, cacheName)) });
    if (s.proc.pid) pids.add(s.proc.pid);
    commands.push({ step: `serve (${target.label})`, argv: [process.execPath, BATON_BIN, 'serve', '--socket', s.socket, '--store', target.store, '--log-level', 'info', ...serverArgs(path.join(dir, cacheName))] });
    return s;
  };
  let ok = false;
  try {
    // ---- build the seed's workspace on the parent
    await batonCli(target, 'create', ['create', PARENT, '--size', String(SIZE)]);
    const A = await start('cache-a');
    let t = performance.now();
    const stack = await attachExport(td, A.uri(PARENT), fs.mkdtempSync(path.join(dir, 'fuse-ws-')), SIZE);
    if (stack.fuse.proc.pid) pids.add(stack.fuse.proc.pid);
    const attachS = since(t);
    t = performance.now();
    await runOk('mkfs.ext4', ['-q', '-F', stack.loop.dev], { timeoutMs: 300_000 });
    const mkfsS = since(t);
    const journal = await journalRanges(stack.loop.dev);
    const mnt = fs.mkdtempSync(path.join(dir, 'mnt-ws-'));
    t = performance.now();
    const mount = await mountExt4(td, stack.loop.dev, mnt);
    const mountS = since(t);
    const repo = path.join(mnt, 'repo');
    t = performance.now();
    await git(['clone', '-q', '--no-hardlinks', fixtures.src, repo], undefined, 300_000);
    const cloneS = since(t);
    const appOnVolume = path.join(mnt, 'app');
    await fsp.cp(fixtures.app, appOnVolume, { recursive: true });
    t = performance.now();
    await runOk('npm', ['ci', '--offline', '--ignore-scripts'], { cwd: appOnVolume, env: npmEnv(fixtures.work), timeoutMs: 300_000 });
    const npmCiS = since(t);
    t = performance.now();
    await runOk('sync', ['-f', mnt], { timeoutMs: 300_000 });
    const syncS = since(t);
    const head = (await git(['-C', repo, 'rev-parse', 'HEAD'])).trim();
    if (head !== fixtures.head) throw new Error(`the clone's HEAD is ${head}, want ${fixtures.head}`);
    const files = await countFiles(mnt);
    const df = spawnSync('df', ['-B1', '--output=used', mnt], { encoding: 'utf8' });
    const usedBytes = Number(df.stdout.trim().split('\n')[1] ?? NaN);
    t = performance.now();
    await detachExport(stack, mount);
    const unmountS = since(t);
    await waitClosed(A, [PARENT]);
    const beforeForks = await target.objectBytes();
    log(`  [${target.label}] workspace built (${files} files, ${formatSize(usedBytes)} used on ext4): mkfs ${mkfsS.toFixed(1)} s, clone ${cloneS.toFixed(1)} s, npm ci ${npmCiS.toFixed(1)} s, sync ${syncS.toFixed(1)} s; store ${formatSize(beforeForks)}`);

    // ---- three forks
    const forks: TargetResult['forks'] = [];
    for (const f of FORKS) {
      const r = await batonCli(target, 'fork', ['fork', PARENT, f, '--json']);
      forks.push({ name: f, reportedMs: (JSON.parse(r.stdout) as { ms: number }).ms, wallMs: r.seconds * 1000 });
    }
    const afterForks = await target.objectBytes();
    log(`  [${target.label}] forks ${forks.map((f) => `${f.name} ${f.reportedMs} ms (process ${f.wallMs.toFixed(0)} ms)`).join(', ')}; store +${afterForks - beforeForks} B`);

    // ---- each fork: attach + mount + git status, then its own commit
    const work: ForkWork[] = [];
    for (const [k, f] of FORKS.entries()) {
      const { m, times } = await attachMount(td, A, dir, f, pids);
      const r = path.join(m.dir, 'repo');
      t = performance.now();
      const c = await forkCommit(r, f, k);
      const commitS = since(t);
      const h = (await git(['-C', r, 'rev-parse', 'HEAD'])).trim();
      t = performance.now();
      await detachExport(m.stack, m.mount);
      const unmountS2 = since(t);
      work.push({ name: f, ...times, commitS, unmountS: unmountS2, head: h, ...c });
      log(`  [${target.label}] ${f}: attach ${times.attachS.toFixed(2)} s + mount ${times.mountS.toFixed(2)} s + git status ${times.gitStatusS.toFixed(2)} s; commit ${commitS.toFixed(2)} s, umount+detach ${unmountS2.toFixed(2)} s`);
    }
    if (new Set(work.map((w) => w.head)).size !== FORKS.length) throw new Error('the forks did not make three different commits');
    await waitClosed(A, FORKS);

    // ---- git fsck on all four (read-only mounts)
    const heads = new Map<string, string>([[PARENT, head], ...work.map((w): [string, string] => [w.name, w.head])]);
    const fsck: FsckResult[] = [];
    for (const name of [PARENT, ...FORKS]) {
      const { m } = await attachMount(td, A, dir, name, pids, 'ro');
      fsck.push(await fsckRepo(name, path.join(m.dir, 'repo'), heads.get(name)!));
      await detachExport(m.stack, m.mount);
    }
    await waitClosed(A, [PARENT, ...FORKS]);
    log(`  [${target.label}] git fsck --full: ${fsck.map((x) => `${x.name} ${x.ok ? 'ok' : 'FAILED'} (${x.seconds.toFixed(2)} s)`).join(', ')}`);
    const bad = fsck.filter((x) => !x.ok);
    if (bad.length) throw new Error(`git fsck failed: ${bad.map((x) => `${x.name}: ${x.problems}`).join('\n')}`);
    const afterCommits = await target.objectBytes();
    const ls = await lsJson(target);
    const diffs: TargetResult['diffs'] = [];
    for (const f of FORKS) {
      const d = JSON.parse((await batonCli(target, 'diff', ['diff', PARENT, f, '--json'])).stdout) as { differentBytes: number; ranges: { offset: number; length: number }[] };
      diffs.push({ name: f, differentBytes: d.differentBytes, ranges: d.ranges.length, inJournal: overlap(d.ranges, journal) });
    }

    // ---- drop two forks, collect garbage
    const removed = ['w2', 'w3'];
    for (const f of removed) await batonCli(target, 'rm', ['rm', f]);
    const afterRm = await target.objectBytes();
    await A.stop();
    const serverExit = A.proc.exitCode === 0 ? 'exit 0' : `exit ${A.proc.exitCode ?? A.proc.signalCode}`;
    t = performance.now();
    const runs = await gcUntilQuiet(target.store, { env: target.env });
    const gcSeconds = since(t);
    commands.push({ step: `gc (${target.label}, repeated until quiet)`, argv: [process.execPath, BATON_BIN, 'gc', '--store', target.store, '--grace', '2s', '--json'] });
    const afterGc = await target.objectBytes();
    const lsAfter = await lsJson(target);
    log(`  [${target.label}] rm ${removed.join(', ')}: store ${formatSize(afterCommits)} -> ${formatSize(afterRm)}; gc (${runs.length} runs, ${gcSeconds.toFixed(1)} s): -> ${formatSize(afterGc)}`);

    // ---- the survivor, on a new server with an empty cache
    const B = await start('cache-b');
    const survivor = 'w1';
    const { m, times } = await attachMount(td, B, dir, survivor, pids);
    const sf = await fsckRepo(survivor, path.join(m.dir, 'repo'), heads.get(survivor)!);
    const npmLs = await run('npm', ['ls', '--all'], { cwd: path.join(m.dir, 'app'), env: npmEnv(fixtures.work), timeoutMs: 120_000 });
    const npmLsOk = npmLs.code === 0 && !/missing|invalid|extraneous|ERR/i.test(npmLs.stdout + npmLs.stderr);
    await m.mount.unmount();
    const e2 = await run('e2fsck', ['-fn', m.stack.loop.dev], { timeoutMs: 300_000 });
    await m.stack.loop.detach();
    await m.stack.fuse.unmount();
    // The parent the survivor shares most of its blocks with, after the removals and gc.
    const p = await attachMount(td, B, dir, PARENT, pids, 'ro');
    const pf = await fsckRepo(PARENT, path.join(p.m.dir, 'repo'), heads.get(PARENT)!);
    await detachExport(p.m.stack, p.m.mount);
    await B.stop();
    log(`  [${target.label}] survivor ${survivor} on a cold server: attach ${times.attachS.toFixed(2)} + mount ${times.mountS.toFixed(2)} + git status ${times.gitStatusS.toFixed(2)} s; git fsck ${sf.ok ? 'ok' : 'FAILED'}, npm ls ${npmLsOk ? 'ok' : 'FAILED'}, e2fsck -fn ${e2.code === 0 ? 'clean' : 'FAILED'}; parent ${PARENT}: git fsck ${pf.ok ? 'ok' : 'FAILED'}`);
    if (!sf.ok) throw new Error(`git fsck of the survivor failed: ${sf.problems}`);
    if (!pf.ok) throw new Error(`git fsck of the parent after rm + gc failed: ${pf.problems}`);
    if (!npmLsOk) throw new Error(`npm ls of the survivor failed: ${npmLs.output}`);
    if (e2.code !== 0) throw new Error(`e2fsck -fn of the survivor: ${e2.output}`);
    ok = true;
    return {
      label: target.label,
      build: { attachS, mkfsS, mountS, cloneS, npmCiS, syncS, unmountS, usedBytes, files, head },
      bytes: { beforeForks, afterForks, afterCommits, afterRm, afterGc },
      forks, work, fsck, ls, diffs, journal,
      gc: { removed, runs, seconds: gcSeconds, lsAfter },
      survivor: { name: survivor, ...times, fsck: sf, npmLsOk, e2fsckOk: e2.code === 0, parentFsck: pf },
      serverExit,
    };
  } finally {
    const errors = await td.runAll();
    for (const e of errors) log(`  [${target.label}] teardown: ${e.message}`);
    if (ok && errors.length) throw new Error(`teardown failed: ${errors.map((e) => e.message).join('; ')}`);
  }
}

// ------------------------------------------------------------------ report

interface Report {
  machine: ReturnType<typeof machineInfo>;
  loadavgAtEnd: number[];
  durationS: number;
  fixturesS: number;
  knobs: { SIZE: number; SEED: number; RGW: boolean };
  rgw: string | null;
  targets: TargetResult[];
  errors: { step: string; error: string }[];
  commands: { step: string; argv: string[] }[];
}

const mib = (b: number): string => `${fmt(b / MiB)} MiB`;
const secs = (s: number): string => `${fmt(s)} s`;

function render(r: Report): string {
  const m = r.machine;
  const T = r.targets;
  const L: string[] = [];
  L.push('# Three forks of the seed\'s workspace', '');
  L.push(`${m.date.slice(0, 16).replace('T', ' ')} UTC on \`${m.hostname}\`: ${m.nproc} cores (${m.cpuModel}), ${m.memTotalGiB} GiB RAM, ${m.kernel}; **load average ${m.loadavgAtStart.join(' ')} at start, ${r.loadavgAtEnd.join(' ')} at end** (a shared machine: other jobs ran meanwhile, times are noisy; store bytes are not).`);
  L.push(`node ${m.node}; ${toolLine('git')}; npm ${toolLine('npm', '--version')}; baton ${m.batonCommit ?? '?'} (working tree as built). Whole run ${r.durationS.toFixed(0)} s (fixtures ${r.fixturesS.toFixed(1)} s). Temp dir ${m.tmpdir} (${m.tmpdirFs ?? '?'}).`);
  L.push(`Produced by \`node dist/bench/workspace-forks.js\` (after \`npx tsc -p .\`; or \`SCENARIOS=workspace-forks npm run bench\`). Knobs: SIZE=${formatSize(r.knobs.SIZE)}, SEED=${r.knobs.SEED}, RGW=${r.knobs.RGW ? 1 : 0}.`, '');
  L.push('The workspace: a `git clone --no-hardlinks` of the seed scenario\'s repository (test/helpers/workspace.ts: 312 files, text and binary, 3 commits) and an `npm ci --offline --ignore-scripts` of its project (three local tarballs) on ext4 (`mkfs.ext4 -q -F`) over nbdfuse + loop, `sync -f`, umount. Then `baton fork ws w1|w2|w3`; each fork is attached, mounted, `git status`-ed, gets its own commit (edits to the 17 text files of one package, a new 128/256/384 KiB binary and notes, the 9 data files of another package deleted), unmounted. `git fsck --full --strict` on all four (read-only mounts), `baton rm w2 w3`, `baton gc --grace 2s` until quiet, and the survivor w1 (and the parent) checked again from a new server with an empty cache. Every baton process: `BATON_MAX_OPERATION_MS=1000`, `--lease-ttl 60`, `--idle-grace 0.2`, own cache dir.', '');
  L.push('The parent is unmounted cleanly before it is forked, so a fork\'s mount finds a clean journal (nothing to replay): "mount" is ext4\'s mount of a clean filesystem over baton. "4× the parent" is four times everything the store held for the parent before the forks (what four independent copies would hold).', '');
  if (T.length) {
    const col = (f: (x: TargetResult) => string): string[] => T.map(f);
    const rows: string[][] = [];
    const add = (label: string, f: (x: TargetResult) => string): void => { rows.push([label, ...col(f)]); };
    add('workspace: files / used on ext4', (x) => `${x.build.files} / ${mib(x.build.usedBytes)}`);
    add('build: mkfs.ext4 / git clone / npm ci / sync -f', (x) => `${secs(x.build.mkfsS)} / ${secs(x.build.cloneS)} / ${secs(x.build.npmCiS)} / ${secs(x.build.syncS)}`);
    add('`baton fork` w1, w2, w3: ms printed (`--json` ms)', (x) => x.forks.map((f) => fmt(f.reportedMs)).join(', '));
    add('`baton fork` w1, w2, w3: process wall, ms', (x) => x.forks.map((f) => fmt(f.wallMs)).join(', '));
    add('fork: nbdfuse + losetup, s (w1, w2, w3)', (x) => x.work.map((w) => fmt(w.attachS)).join(', '));
    add('fork: mount, s (w1, w2, w3)', (x) => x.work.map((w) => fmt(w.mountS)).join(', '));
    add('fork: first `git status`, s (w1, w2, w3)', (x) => x.work.map((w) => fmt(w.gitStatusS)).join(', '));
    add('fork: attach + mount + first `git status`, s', (x) => x.work.map((w) => fmt(w.totalS)).join(', '));
    add('fork: its commit (edit, add, rm, git commit), s', (x) => x.work.map((w) => fmt(w.commitS)).join(', '));
    add('fork: umount + detach (flush to the store), s', (x) => x.work.map((w) => fmt(w.unmountS)).join(', '));
    add('`baton diff ws wN`: bytes differing from the parent (ranges), w1, w2, w3', (x) => x.diffs.map((d) => `${mib(d.differentBytes)} (${d.ranges})`).join(', '));
    add('… of which in ext4\'s journal, w1, w2, w3', (x) => x.diffs.map((d) => mib(d.inJournal)).join(', '));
    add('`git fsck --full --strict`: ws, w1, w2, w3', (x) => x.fsck.map((f) => `${f.ok ? '✓' : '✗'} ${fmt(f.seconds)} s`).join(', '));
    add('store bytes (vol/): parent before the forks', (x) => mib(x.bytes.beforeForks));
    add('… after the three forks (before any write)', (x) => `${mib(x.bytes.afterForks)} (+${fmt(x.bytes.afterForks - x.bytes.beforeForks)} B)`);
    add('… after the three forks\' commits', (x) => mib(x.bytes.afterCommits));
    add('… four full copies of the parent would be (4×)', (x) => mib(4 * x.bytes.beforeForks));
    add('… saving from sharing (1 − actual ÷ 4×)', (x) => `${((1 - x.bytes.afterCommits / (4 * x.bytes.beforeForks)) * 100).toFixed(1)} %`);
    add('… the three forks cost on top of the parent', (x) => `${mib(x.bytes.afterCommits - x.bytes.beforeForks)} (${((x.bytes.afterCommits - x.bytes.beforeForks) / x.bytes.beforeForks * 100).toFixed(1)} % of it)`);
    add('… after `baton rm w2 w3`', (x) => `${mib(x.bytes.afterRm)} (−${mib(x.bytes.afterCommits - x.bytes.afterRm)})`);
    add('… after `baton gc --grace 2s` until quiet', (x) => `${mib(x.bytes.afterGc)} (−${mib(x.bytes.afterRm - x.bytes.afterGc)}; ${x.gc.runs.length} runs, ${secs(x.gc.seconds)})`);
    add('survivor w1, new server, empty cache: attach + mount + `git status`, s', (x) => `${fmt(x.survivor.totalS)} (${fmt(x.survivor.attachS)} + ${fmt(x.survivor.mountS)} + ${fmt(x.survivor.gitStatusS)})`);
    add('survivor w1: git fsck / npm ls / e2fsck -fn; parent ws: git fsck', (x) => `${x.survivor.fsck.ok ? '✓' : '✗'} / ${x.survivor.npmLsOk ? '✓' : '✗'} / ${x.survivor.e2fsckOk ? '✓' : '✗'}; ${x.survivor.parentFsck.ok ? '✓' : '✗'}`);
    L.push('## Results', '', markdownTable(['measure', ...T.map((x) => x.label)], rows, ['l', ...T.map((): 'r' => 'r')]));
    if (r.rgw) L.push(`radosgw: ${r.rgw}.`, '');

    L.push('## `baton ls --json` after the commits (before rm)', '');
    const lsRows: string[][] = [];
    for (const x of T) {
      for (const v of x.ls) lsRows.push([x.label, v.name, v.parent ? `fork of ${PARENT}` : 'root', mib(v.writtenBytes ?? NaN), mib(v.exclusiveBytes ?? NaN), mib(v.sharedBytes ?? NaN), mib(v.storedBytes ?? NaN)]);
    }
    L.push(markdownTable(['store', 'volume', 'kind', 'written', 'exclusive', 'shared', 'storedBytes'], lsRows, ['l', 'l', 'l', 'r', 'r', 'r', 'r']));
    L.push('written = bytes the volume\'s map references; exclusive = referenced by no other volume; shared = the rest (exclusive + shared = written). After rm + gc:', '');
    const lsAfterRows: string[][] = [];
    for (const x of T) for (const v of x.gc.lsAfter) lsAfterRows.push([x.label, v.name, mib(v.writtenBytes ?? NaN), mib(v.exclusiveBytes ?? NaN), mib(v.sharedBytes ?? NaN)]);
    L.push(markdownTable(['store', 'volume', 'written', 'exclusive', 'shared'], lsAfterRows, ['l', 'l', 'r', 'r', 'r']));
    L.push('gc runs (deleted objects / bytes, marked, young unreferenced): ' + T.map((x) => `${x.label} ${x.gc.runs.map((g) => `${g.deletedObjects}/${mib(g.deletedBytes)}, ${g.markedObjects}, ${g.youngUnreferenced}`).join(' → ')}`).join('; ') + '.', '');
  }
  if (r.errors.length) L.push('## Errors', '', ...r.errors.map((e) => `- ${e.step}: ${e.error.replace(/\n/g, ' ')}`), '');
  L.push('## Commands', '', '$TMP = the run\'s private temp dir; every baton process also had BATON_MAX_OPERATION_MS=1000 and BATON_HOME=$TMP/home (radosgw: its endpoint and credentials in the environment).', '', '```sh');
  const seen = new Set<string>();
  for (const c of r.commands) {
    const line = shellQuote(c.argv).replaceAll(REPO_ROOT + '/', '').replace(/\/tmp\/baton-bench-wsfork-[^/ ']+/g, '$TMP').replace(/\/tmp\/baton-test-[^/ ']+/g, '$TMP');
    const key = `${c.step}\n${line}`;
    if (seen.has(key)) continue;
    seen.add(key);
    L.push(`# ${c.step}`, line);
  }
  L.push('```', '');
  return L.join('\n');
}

function toolLine(tool: string, flag = '--version'): string {
  const r = spawnSync(tool, [flag], { encoding: 'utf8' });
  return (r.stdout ?? '').trim().split('\n')[0] ?? '?';
}

// ------------------------------------------------------------------ main

async function main(): Promise<void> {
  const missing = TOOLS.filter((x) => !has(x));
  if (!IS_ROOT || missing.length || !fs.existsSync('/dev/fuse') || !fs.existsSync('/dev/loop-control')) {
    log(`workspace-forks: skipped: needs root (${IS_ROOT ? 'yes' : 'no'}), /dev/fuse, /dev/loop-control and ${TOOLS.join(', ')} (missing: ${missing.join(', ') || 'none'})`);
    return;
  }
  const machine = machineInfo();
  const started = performance.now();
  const root = makeTempDir('baton-bench-wsfork-');
  const pids = new Set<number>();
  installExitUndo(root, pids);
  // Every baton process (the helpers spawn with process.env): GC's bound, and a private BATON_HOME (local leases).
  process.env.BATON_MAX_OPERATION_MS = GC_TEST_ENV.BATON_MAX_OPERATION_MS;
  process.env.BATON_HOME = path.join(root, 'home');
  // The helpers' tempDir() (server sockets) follows os.tmpdir(): inside the run's dir, so an interrupted run leaves none behind.
  process.env.TMPDIR = root;
  log(`workspace-forks bench: ${machine.nproc} cores, load ${machine.loadavgAtStart.join(' ')}, temp dir ${root}`);

  // ---- fixtures, outside any volume (once, shared by every store)
  const t0 = performance.now();
  const fx = path.join(root, 'fixtures');
  fs.mkdirSync(fx);
  const src = path.join(fx, 'src');
  await makeSourceRepo(src, rngFrom(SEED));
  const { app } = await makeNpmProject(fx);
  const head = (await git(['-C', src, 'rev-parse', 'HEAD'])).trim();
  const fixturesS = since(t0);
  log(`fixtures ready in ${fixturesS.toFixed(1)} s`);

  const errors: Report['errors'] = [];
  const targets: TargetResult[] = [];
  let rgwVersion: string | null = null;

  const fileStore = `file:${path.join(root, 'file-store')}`;
  const stores: (() => Promise<{ target: Target; done: () => Promise<void> }>)[] = [
    async () => ({ target: { label: 'file:', store: fileStore, env: {}, objectBytes: () => storeObjectBytes(fileStore) }, done: async () => {} }),
  ];
  if (RGW) {
    stores.push(async () => {
      const { rgw, version, credentials } = await startRgwBucket(path.join(root, 'rgw'), BUCKET);
      rgwVersion = version;
      const url = `s3://${BUCKET}/workspace`;
      const store = openStore(url, { endpoint: rgw.endpoint, credentials });
      return {
        target: { label: 'radosgw', store: url, env: rgw.env, objectBytes: async () => (await listAll(store, 'vol/')).reduce((n, o) => n + o.size, 0) },
        done: async () => {
          await store.close().catch(() => {});
          await rgw.stop();
        },
      };
    });
  }

  for (const open of stores) {
    let opened: Awaited<ReturnType<typeof open>> | null = null;
    try {
      opened = await open();
      log(`[${opened.target.label}]`);
      targets.push(await scenario(opened.target, { src, app, work: fx, head }, root, pids));
    } catch (e) {
      const label = opened?.target.label ?? 'radosgw';
      log(`  [${label}] ERROR ${(e as Error).stack ?? String(e)}`);
      errors.push({ step: label, error: (e as Error).message });
    } finally {
      await opened?.done().catch((e: unknown) => log(`  cleanup: ${String(e)}`));
    }
  }

  const report: Report = {
    machine, loadavgAtEnd: os.loadavg().map((x) => Math.round(x * 100) / 100), durationS: since(started), fixturesS,
    knobs: { SIZE, SEED, RGW }, rgw: rgwVersion, targets, errors, commands,
  };
  const out = writeResults('workspace-forks', render(report), report);
  log(`workspace-forks bench: ${out.md}, ${out.json} (${report.durationS.toFixed(0)} s)`);
  if (errors.length) process.exitCode = 1;
}

await main();
