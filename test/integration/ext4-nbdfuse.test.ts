/**
 * A real kernel ext4 on a baton volume, without the kernel NBD module:
 *   baton serve -> nbdfuse -> loop device -> mkfs.ext4 / mount / git / fstrim / e2fsck
 * then a graceful server stop, a NEW server process on the same file: store, and the same
 * files checked again through a fresh nbdfuse + loop mount (notes/nbd-protocol.md §4.3).
 */

import test from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { attachExport, detachExport, mountExt4, run, runOk, sha256, sha256File, type Stack } from '../helpers/ext4.js';
import { has, startBatonServer, tempDir, type BatonServer, type Teardown } from '../helpers/server.js';

const TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'mount', 'umount', 'fstrim', 'git'];
const missing = TOOLS.filter((tool) => !has(tool));
const isRoot = process.getuid?.() === 0;
const canRun = isRoot && missing.length === 0 && fs.existsSync('/dev/fuse') && fs.existsSync('/dev/loop-control');
const serial = canRun ? test.serial : test.serial.skip;
if (!canRun) console.warn(`ext4-nbdfuse: skipped (root: ${isRoot}, missing tools: ${missing.join(', ') || 'none'}, /dev/fuse: ${fs.existsSync('/dev/fuse')})`);

const VOLUME = 'fs';
const VOLUME_SIZE = 256 * 1024 * 1024;
const GIT = ['-c', 'user.name=baton test', '-c', 'user.email=baton@example.invalid', '-c', 'init.defaultBranch=main', '-c', 'safe.directory=*'];

/** nbdfuse + loop for the test volume. */
function attach(t: Teardown, server: BatonServer): Promise<Stack> {
  return attachExport(t, server.uri(VOLUME), tempDir(t, 'baton-fuse-'), VOLUME_SIZE);
}

const detach = detachExport;

/** Sorted { relative path: sha256 } for every regular file under root (excluding .git). */
async function hashTree(root: string): Promise<Record<string, string>> {
  const out = new Map<string, string>();
  const walk = async (rel: string): Promise<void> => {
    for (const e of await fsp.readdir(path.join(root, rel), { withFileTypes: true })) {
      const r = path.join(rel, e.name);
      if (e.isDirectory()) { if (e.name !== '.git' && e.name !== 'lost+found') await walk(r); }
      else if (e.isFile()) out.set(r, await sha256File(path.join(root, r)));
    }
  };
  await walk('');
  return sorted(out);
}

function sorted(m: Map<string, string>): Record<string, string> {
  return Object.fromEntries([...m.entries()].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
}

serial('ext4 on nbdfuse + loop: mkfs, files with fsync, git, remount, fstrim, e2fsck, then a new server process sees the same files', async (t) => {
  const server = await startBatonServer(t, { volumes: [{ name: VOLUME, size: VOLUME_SIZE }] });
  const mnt = tempDir(t, 'baton-mnt-');

  // ---- first server: make the filesystem and fill it
  const s1 = await attach(t, server);
  await runOk('mkfs.ext4', ['-q', '-F', s1.loop.dev], { timeoutMs: 60_000 });
  let m = await mountExt4(t, s1.loop.dev, mnt);

  const expected = new Map<string, string>();
  for (let d = 0; d < 12; d++) {
    await fsp.mkdir(path.join(mnt, `dir${d}`, 'sub'), { recursive: true });
    for (let i = 0; i < 25; i++) {
      const rel = path.join(`dir${d}`, i % 2 ? 'sub' : '', `file${i}.txt`);
      const data = randomBytes(1 + ((d * 31 + i * 977) % 9000));
      const fh = await fsp.open(path.join(mnt, rel), 'w');
      await fh.writeFile(data);
      await fh.sync();
      await fh.close();
      expected.set(rel, sha256(data));
    }
  }
  const big = randomBytes(16 * 1024 * 1024);
  {
    const fh = await fsp.open(path.join(mnt, 'big.bin'), 'w');
    await fh.writeFile(big);
    await fh.sync();
    await fh.close();
    expected.set('big.bin', sha256(big));
  }
  t.is(expected.size, 301);

  await runOk('git', [...GIT, 'init', '-q', mnt]);
  await runOk('git', [...GIT, '-C', mnt, 'add', '-A'], { timeoutMs: 60_000 });
  await runOk('git', [...GIT, '-C', mnt, 'commit', '-q', '-m', 'baton ext4 round trip'], { timeoutMs: 60_000 });
  const head = (await runOk('git', [...GIT, '-C', mnt, 'rev-parse', 'HEAD'])).stdout.trim();
  t.regex(head, /^[0-9a-f]{40}$/);
  await runOk('sync', []);
  await m.unmount();

  // ---- remount on the same stack: the data came back from the server, not the page cache
  m = await mountExt4(t, s1.loop.dev, mnt);
  t.deepEqual(await hashTree(mnt), sorted(expected), 'file contents after remount');
  const fsck = await run('git', [...GIT, '-C', mnt, 'fsck', '--full', '--strict'], { timeoutMs: 60_000 });
  t.is(fsck.code, 0, fsck.output);
  t.notRegex(fsck.stdout + fsck.stderr, /error|missing|corrupt|broken/i, fsck.output);
  const log = await runOk('git', [...GIT, '-C', mnt, 'log', '--format=%H %s']);
  t.is(log.stdout.trim(), `${head} baton ext4 round trip`);
  const status = await runOk('git', [...GIT, '-C', mnt, 'status', '--porcelain']);
  t.is(status.stdout, '', 'work tree matches the commit');

  const trim = await run('fstrim', ['-v', mnt], { timeoutMs: 60_000 });
  t.is(trim.code, 0, trim.output);
  t.regex(trim.stdout, /trimmed/, trim.output);
  // Trimmed free space must not have eaten file data.
  t.is(await sha256File(path.join(mnt, 'big.bin')), expected.get('big.bin')!);
  await m.unmount();

  const e2 = await run('e2fsck', ['-fn', s1.loop.dev], { timeoutMs: 60_000 });
  t.is(e2.code, 0, e2.output);
  await detach(s1);
  t.is(s1.fuse.proc.exitCode, 0, `nbdfuse exit: ${s1.fuse.stderr()}`);

  // ---- graceful stop; a NEW server process on the same store
  await server.stop();
  t.is(server.proc.exitCode, 0, `first server exit status; stderr:\n${server.stderr()}`);
  const server2 = await startBatonServer(t, { store: server.store });
  t.not(server2.proc.pid, server.proc.pid);

  const s2 = await attach(t, server2);
  const e2b = await run('e2fsck', ['-fn', s2.loop.dev], { timeoutMs: 60_000 });
  t.is(e2b.code, 0, `e2fsck after restart: ${e2b.output}`);
  const m2 = await mountExt4(t, s2.loop.dev, mnt);
  t.deepEqual(await hashTree(mnt), sorted(expected), 'file contents after a server restart');
  const fsck2 = await run('git', [...GIT, '-C', mnt, 'fsck', '--full', '--strict'], { timeoutMs: 60_000 });
  t.is(fsck2.code, 0, fsck2.output);
  const log2 = await runOk('git', [...GIT, '-C', mnt, 'log', '--format=%H %s']);
  t.is(log2.stdout.trim(), `${head} baton ext4 round trip`);
  await detach(s2, m2);
  t.is(s2.fuse.proc.exitCode, 0, `nbdfuse exit: ${s2.fuse.stderr()}`);
  await server2.stop();
  t.is(server2.proc.exitCode, 0, `second server exit status; stderr:\n${server2.stderr()}`);
});
