/**
 * The seed scenario, through a real kernel ext4 (nbdfuse + loop, notes/nbd-protocol.md §4.3),
 * on Ceph RGW when radosgw is installed (else a file: store):
 *
 *   host A: mkfs.ext4, mount; `git clone` a local repository (300+ files, 3 commits) onto the
 *   volume; `npm ci --offline` a project whose dependencies are local `npm pack` tarballs
 *   (the registry is a closed loopback port: any registry traffic would fail the run); sync;
 *   `git commit` (C1) and sync; `git add` + `git commit` (C2) with git's own fsyncs only
 *   (core.fsync=all set in the clone); unsynced churn
 *   with a background sync; then SIGKILL the server WITHOUT unmounting, at a seeded random
 *   moment, and tear the dead stack down forcibly (umount -l, losetup -d, fusermount3 -uz).
 *
 *   host B (a new process with an EMPTY cache dir, same store): nbdfuse + loop + mount (ext4
 *   replays its journal); C1 is in `git log` and HEAD is C1 or C2; `git fsck --full` clean;
 *   the clone's files match the index; `npm ls` clean and node_modules identical to a
 *   reference install; umount; `e2fsck -fn` clean.
 *
 * Why the syncs: npm never fsyncs, and git 2.39 by default fsyncs neither loose objects nor
 * refs (without core.fsync=all a crash right after `git add` leaves empty object files that
 * `git fsck` rightly reports); even with core.fsync=all the final rename of the branch ref is
 * only made durable by ext4's next journal commit (up to 5 s later). So the test makes its
 * durability points explicit (syncfs, which ext4 turns into a journal commit = FLUSH/FUA to
 * baton) and asserts exactly those; C2 (git's own fsyncs, no sync) may or may not survive,
 * but whichever HEAD and index survive, every object they name must be intact (git fsyncs
 * objects before the index and the ref that name them).
 *
 * The fixtures (source repository, npm project, offline npm environment) are in
 * test/helpers/workspace.ts, shared with bench/workspace-forks.ts.
 *
 * Every layer registers its teardown the moment it exists; AVA runs them in reverse order, so
 * a failure anywhere leaves no mount, loop device, FUSE mount or process behind.
 */

import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { attachLoop, isMountpoint, mountExt4, run, runOk, sha256File, startNbdfuse, type FuseExport, type LoopDevice, type Mount } from '../helpers/ext4.js';
import { hasS3, makeTestBucket, s3TestEnv } from '../helpers/s3.js';
import { baton, has, startBatonServer, tempDir, type BatonServer } from '../helpers/server.js';
import { GIT, PACKAGES, git, makeNpmProject, makeSourceRepo, npmEnv } from '../helpers/workspace.js';
import { randInt, rngFrom } from '../helpers/writer.js';

const TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'mount', 'umount', 'git', 'npm', 'sync', 'sh'];
const missing = TOOLS.filter((tool) => !has(tool));
const isRoot = process.getuid?.() === 0;
const canRun = isRoot && missing.length === 0 && fs.existsSync('/dev/fuse') && fs.existsSync('/dev/loop-control');
const serial = canRun ? test.serial : test.serial.skip;
if (!canRun) console.warn(`seed-scenario: skipped (root: ${isRoot}, missing tools: ${missing.join(', ') || 'none'}, /dev/fuse: ${fs.existsSync('/dev/fuse')})`);

const SEED = process.env.BATON_CRASH_SEED !== undefined ? Number(process.env.BATON_CRASH_SEED) >>> 0 : randomBytes(4).readUInt32BE(0);

const VOLUME = 'seed';
const VOLUME_SIZE = 256 * 1024 * 1024;

interface Target { store: string; env: Record<string, string>; storeArgs: string[]; label: string }

interface Stack { fuse: FuseExport; loop: LoopDevice; mount: Mount; dir: string }

/** Sorted { relative path: sha256 | ->link } of a tree. */
async function hashTree(root: string, skip: (rel: string) => boolean = () => false): Promise<Record<string, string>> {
  const out: [string, string][] = [];
  const walk = async (rel: string): Promise<void> => {
    for (const e of await fsp.readdir(path.join(root, rel), { withFileTypes: true })) {
      const r = path.join(rel, e.name);
      if (skip(r)) continue;
      if (e.isDirectory()) await walk(r);
      else if (e.isSymbolicLink()) out.push([r, '->' + (await fsp.readlink(path.join(root, r)))]);
      else if (e.isFile()) out.push([r, await sha256File(path.join(root, r))]);
    }
  };
  await walk('');
  return Object.fromEntries(out.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
}

/**
 * A host: a new process with an empty cache dir. It takes the volume's lease (a lease file,
 * free at once when its holder is dead); a long TTL, so that late renewals on a loaded machine
 * do not make it give the lease up (which closes nbdfuse's connections: EIO under ext4).
 */
async function startHost(t: ExecutionContext, target: Target): Promise<BatonServer> {
  const cache = path.join(tempDir(t, 'baton-seed-cache-'), 'cache');
  return startBatonServer(t, { store: target.store, env: target.env, extraArgs: [...target.storeArgs, '--cache-dir', cache, '--lease-ttl', '60'] });
}

/** nbdfuse + loop (+ mkfs) + mount; each layer's teardown registered as soon as it exists. */
async function attach(t: ExecutionContext, server: BatonServer, mkfs: boolean): Promise<Stack> {
  const fuse = await startNbdfuse(t, server.uri(VOLUME), tempDir(t, 'baton-seed-fuse-'));
  const st = await fsp.stat(fuse.file);
  if (st.size !== VOLUME_SIZE) throw new Error(`nbdfuse file has size ${st.size}, want ${VOLUME_SIZE}`);
  const loop = await attachLoop(t, fuse.file);
  if (mkfs) await runOk('mkfs.ext4', ['-q', '-F', loop.dev], { timeoutMs: 120_000 });
  const dir = tempDir(t, 'baton-seed-mnt-');
  const mount = await mountExt4(t, loop.dev, dir);
  return { fuse, loop, mount, dir };
}

/** The server under this stack is dead: tear it down without waiting for I/O that cannot complete. */
async function forceDetach(t: ExecutionContext, s: Stack): Promise<void> {
  if (isMountpoint(s.dir)) {
    const u = await run('umount', ['-l', s.dir], { timeoutMs: 20_000 });
    if (u.code !== 0) t.log(`umount -l: ${u.output}`);
  }
  await s.mount.unmount(); // marks it done (no longer a mountpoint)
  await s.loop.detach().catch((err: unknown) => t.log(`losetup -d after the crash: ${String(err)}`));
  if (isMountpoint(s.fuse.dir)) await run('fusermount3', ['-u', '-z', s.fuse.dir], { timeoutMs: 20_000 });
  if (s.fuse.proc.exitCode === null && s.fuse.proc.signalCode === null) {
    await new Promise((r) => setTimeout(r, 500));
    if (s.fuse.proc.exitCode === null && s.fuse.proc.signalCode === null) s.fuse.proc.kill('SIGKILL');
  }
  await s.fuse.unmount(); // waits for nbdfuse to be gone; idempotent
}

serial('seed scenario: git clone + npm ci + git commit on ext4, SIGKILL the server without unmounting, a fresh host replays the journal and everything synced is intact', async (t) => {
  t.timeout(600_000);
  const t0 = Date.now();
  const rng = rngFrom(SEED);
  t.log(`seed ${SEED} (rerun with BATON_CRASH_SEED=${SEED})`);

  let target: Target;
  if (hasS3()) {
    const s3 = await s3TestEnv(t);
    const bucket = await makeTestBucket(s3);
    target = {
      label: 'Ceph RGW', store: `s3://${bucket}/seed`, storeArgs: ['--endpoint', s3.endpoint],
      // BATON_HOME: s3:// volumes keep their lease files under $BATON_HOME/leases, by volume name.
      env: { AWS_ACCESS_KEY_ID: s3.accessKeyId, AWS_SECRET_ACCESS_KEY: s3.secretAccessKey, AWS_REGION: s3.region, BATON_HOME: tempDir(t, 'baton-seed-home-') },
    };
  } else {
    target = { label: 'file:', store: `file:${path.join(tempDir(t, 'baton-seed-store-'), 'store')}`, env: { BATON_HOME: tempDir(t, 'baton-seed-home-') }, storeArgs: [] };
  }
  t.log(`store: ${target.label} ${target.store}`);
  const created = baton(['create', VOLUME, '--size', String(VOLUME_SIZE), '--store', target.store, ...target.storeArgs], target.env);
  if (created.status !== 0) throw new Error(`baton create failed: ${created.stderr}`);

  // ---- fixtures, outside the volume
  const work = tempDir(t, 'baton-seed-work-');
  const src = path.join(work, 'src');
  await makeSourceRepo(src, rng);
  const srcLog = (await git(['-C', src, 'log', '--format=%H'])).trim().split('\n');
  t.is(srcLog.length, 3);
  const { app, reference } = await makeNpmProject(work);
  const refModules = await hashTree(path.join(reference, 'node_modules'), (r) => r === '.package-lock.json');
  t.true(Object.keys(refModules).length > 120, 'the reference install has the packages');
  const env = npmEnv(work);
  t.log(`fixtures ready in ${Date.now() - t0} ms`);

  // ---- host A
  const a = await startHost(t, target);
  const sa = await attach(t, a, true);
  const repo = path.join(sa.dir, 'repo');
  await git(['clone', '-q', '--no-hardlinks', src, repo]);
  t.is((await git(['-C', repo, 'rev-parse', 'HEAD'])).trim(), srcLog[0] ?? '');
  // git's durable mode for every later command in this repository (add, commit): fsync loose
  // objects, the index and refs. The 2.39 default fsyncs neither loose objects nor refs, and
  // an unsynced `git add` legitimately leaves an empty object file behind after a crash.
  await git(['-C', repo, 'config', 'core.fsync', 'all']);
  await git(['-C', repo, 'config', 'core.fsyncMethod', 'fsync']);
  const appOnVolume = path.join(sa.dir, 'app');
  await fsp.cp(app, appOnVolume, { recursive: true });
  const ci = await runOk('npm', ['ci', '--offline', '--ignore-scripts'], { cwd: appOnVolume, env, timeoutMs: 180_000 });
  t.log(`npm ci --offline on the volume: ${ci.stdout.trim().split('\n').pop()}`);
  // Durability point 1: npm does not fsync.
  await runOk('sync', ['-f', sa.dir], { timeoutMs: 120_000 });

  // C1, made durable; C2 with git's own fsyncs only.
  const agent = path.join(repo, 'agent');
  await fsp.mkdir(agent);
  await fsp.writeFile(path.join(agent, 'notes.md'), `# work of the agent\n${randomBytes(2048).toString('hex')}\n`);
  await fsp.appendFile(path.join(repo, 'pkg0', 'src', 'f1.txt'), 'edited by the agent\n');
  await git(['-C', repo, 'add', '-A']);
  await git(['-C', repo, 'commit', '-q', '-m', 'agent: C1']);
  const c1 = (await git(['-C', repo, 'rev-parse', 'HEAD'])).trim();
  await runOk('sync', ['-f', sa.dir], { timeoutMs: 120_000 });
  await fsp.writeFile(path.join(agent, 'more.bin'), randomBytes(256 * 1024));
  await git(['-C', repo, 'add', '-A']);
  await git(['-C', repo, 'commit', '-q', '-m', 'agent: C2']);
  const c2 = (await git(['-C', repo, 'rev-parse', 'HEAD'])).trim();

  // Unsynced churn, and a background sync pushing it (and C2) out while the server dies.
  const churn = run('sh', ['-c', `dd if=/dev/urandom of='${path.join(sa.dir, 'scratch.bin')}' bs=1M count=24 status=none; sync -f '${sa.dir}'`], { timeoutMs: 60_000 });
  const delay = randInt(rng, 0, 600);
  await new Promise((r) => setTimeout(r, delay));
  t.log(`SIGKILL host A ${delay} ms into the unsynced churn (${Date.now() - t0} ms since start)`);
  await a.kill();
  const ch = await churn;
  t.log(`churn after the kill: exit ${ch.code ?? ch.signal} ${ch.stderr.trim().split('\n')[0] ?? ''}`);
  await forceDetach(t, sa);

  // ---- host B: empty cache, same store; the mount replays ext4's journal
  const b = await startHost(t, target);
  const sb = await attach(t, b, false);
  const repoB = path.join(sb.dir, 'repo');
  const head = (await git(['-C', repoB, 'rev-parse', 'HEAD'])).trim();
  t.true(head === c1 || head === c2, `HEAD is C1 (${c1}) or C2 (${c2}), got ${head}`);
  t.log(`HEAD after the crash: ${head === c2 ? 'C2 (the unsynced commit survived too)' : 'C1 (the unsynced C2 was lost, as allowed)'}`);
  const logB = (await git(['-C', repoB, 'log', '--format=%H'])).trim().split('\n');
  t.deepEqual(logB.slice(-3), srcLog, 'the cloned history is intact');
  t.true(logB.includes(c1), 'the synced commit C1 is in git log');
  const fsck = await run('git', [...GIT, '-C', repoB, 'fsck', '--full', '--strict', '--no-dangling'], { timeoutMs: 120_000 });
  t.is(fsck.code, 0, fsck.output);
  t.notRegex(fsck.stdout + fsck.stderr, /error|missing|corrupt|broken|bad /i, fsck.output);
  // The clone (synced before C1) matches the index exactly, wherever C2 left the agent's files.
  const status = await runOk('git', [...GIT, '-C', repoB, 'status', '--porcelain', '--', '.', ':(exclude)agent']);
  t.is(status.stdout, '', 'the cloned work tree matches the index');
  t.is((await git(['-C', repoB, 'show', `${c1}:agent/notes.md`])).length > 0, true);

  const appB = path.join(sb.dir, 'app');
  const ls = await run('npm', ['ls', '--all'], { cwd: appB, env, timeoutMs: 60_000 });
  t.is(ls.code, 0, ls.output);
  t.notRegex(ls.stdout + ls.stderr, /missing|invalid|extraneous|ERR/i, ls.output);
  for (const n of PACKAGES) t.regex(ls.stdout, new RegExp(`${n}@1\\.0\\.0`), ls.output);
  t.deepEqual(await hashTree(path.join(appB, 'node_modules'), (r) => r === '.package-lock.json'), refModules, 'node_modules identical to the reference install');
  const cli = await run(path.join(appB, 'node_modules', '.bin', 'baton-seed-c'), [], { timeoutMs: 30_000 });
  t.is(cli.stdout.trim(), 'baton-seed-c ok', cli.output);
  const sums = await runOk(process.execPath, ['-e', `for (const n of ${JSON.stringify(PACKAGES)}) console.log(require(n).sum)`], { cwd: appB });
  const refSums = await runOk(process.execPath, ['-e', `for (const n of ${JSON.stringify(PACKAGES)}) console.log(require(n).sum)`], { cwd: reference });
  t.is(sums.stdout, refSums.stdout, 'the packages load and hash the same as the reference');

  await sb.mount.unmount();
  const e2 = await run('e2fsck', ['-fn', sb.loop.dev], { timeoutMs: 120_000 });
  t.is(e2.code, 0, `e2fsck -fn after journal replay: ${e2.output}`);
  await sb.loop.detach();
  await sb.fuse.unmount();
  await b.stop();
  t.is(b.proc.exitCode, 0, `host B exit status; stderr:\n${b.stderr()}`);
  t.log(`seed scenario done in ${((Date.now() - t0) / 1000).toFixed(1)} s on ${target.label}`);
});
