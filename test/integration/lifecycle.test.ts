/**
 * The lifecycle verbs through the CLI (`baton rename`, `resize`, `expire`, `import`,
 * `export`), against real `baton serve` processes and real clients on a `file:` store: what
 * they print, their exit codes (2 for usage errors), and what a host serving the volume sees.
 */

import test from 'ava';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { runOk } from '../helpers/ext4.js';
import { baton, has, startBatonServer, tempDir } from '../helpers/server.js';

const MiB = 1024 * 1024;
const withNbdcopy = has('nbdcopy') ? test : test.skip;

function storeIn(t: { teardown(fn: () => void): void }): string {
  return `file:${path.join(tempDir(t, 'baton-life-'), 'store')}`;
}

function ok(t: { is(a: unknown, b: unknown, m?: string): void }, args: string[]): string {
  const r = baton(args);
  t.is(r.status, 0, `baton ${args.join(' ')}: ${r.stderr}`);
  return r.stdout;
}

function lsNames(store: string): string[] {
  const r = baton(['ls', '--store', store, '--json']);
  return (JSON.parse(r.stdout) as { name: string }[]).map((v) => v.name).sort();
}

test('baton rename: renames, refuses an existing name without --replace, exit 2 for usage errors', (t) => {
  const store = storeIn(t);
  ok(t, ['create', 'a', '--size', '4M', '--store', store]);
  ok(t, ['create', 'work', '--size', '4M', '--store', store]);
  t.is(ok(t, ['rename', 'a', 'b', '--store', store]), 'renamed a to b\n');
  t.deepEqual(lsNames(store), ['b', 'work']);

  const taken = baton(['rename', 'b', 'work', '--store', store]);
  t.is(taken.status, 1, taken.stderr);
  t.regex(taken.stderr, /volume "work" already exists .*add --replace to make b the new work/);
  t.deepEqual(lsNames(store), ['b', 'work'], 'nothing changed');

  for (const [args, re] of [
    [['rename', 'b', 'bad/name'], /invalid volume name "bad\/name"/],
    [['rename', 'b', 'b'], /already has that name/],
    [['rename', 'b', 'x', '--force'], /--force only makes sense with --replace/],
    [['rename', 'work@snap', 'x'], /is a snapshot: fork it/],
    [['rename', 'b'], /missing required argument/],
  ] as const) {
    const r = baton([...args, '--store', store]);
    t.is(r.status, 2, `${args.join(' ')}: ${r.stderr}`);
    t.regex(r.stderr, re);
    t.notRegex(r.stderr, /\n\s+at /, 'no stack trace');
  }
  const missing = baton(['rename', 'nope', 'x', '--store', store]);
  t.is(missing.status, 1);
  t.regex(missing.stderr, /no volume "nope"/);

  const j = JSON.parse(ok(t, ['rename', 'b', 'work', '--replace', '--json', '--store', store])) as { from: string; to: string; replaced: unknown };
  t.is(j.from, 'b');
  t.truthy(j.replaced);
  t.deepEqual(lsNames(store), ['work']);
});

withNbdcopy('baton rename --replace: a served source is refused; a served destination needs --force, and its host drops the old volume', async (t) => {
  const s = await startBatonServer(t, { volumes: [{ name: 'work', size: 8 * MiB }], extraArgs: ['--idle-grace', '60'] });
  const dir = tempDir(t);
  const put = async (name: string, fill: number): Promise<Buffer> => {
    const data = Buffer.alloc(MiB, fill);
    fs.writeFileSync(path.join(dir, 'in.bin'), data);
    await runOk('nbdcopy', ['--flush', path.join(dir, 'in.bin'), s.uri(name)]);
    return data;
  };
  await put('work', 0x41);
  ok(t, ['fork', 'work', 'try-2', '--store', s.store]);
  const attempt = await put('try-2', 0x42); // served now (idle grace 60 s)

  const src = baton(['rename', 'try-2', 'work', '--replace', '--store', s.store]);
  t.is(src.status, 1, src.stderr);
  t.regex(src.stderr, /rename try-2: it is being served by .*detach its clients/);

  // Stop serving try-2 (restart the server: its volumes close and give their leases back), serve work again.
  await s.stop();
  const s2 = await startBatonServer(t, { store: s.store, extraArgs: ['--idle-grace', '60'] });
  fs.writeFileSync(path.join(dir, 'in.bin'), Buffer.alloc(MiB, 0x43));
  await runOk('nbdcopy', ['--flush', path.join(dir, 'in.bin'), s2.uri('work')]);
  const dst = baton(['rename', 'try-2', 'work', '--replace', '--store', s.store]);
  t.is(dst.status, 1, dst.stderr);
  t.regex(dst.stderr, /work is being served by .*add --force/);
  const forced = baton(['rename', 'try-2', 'work', '--replace', '--force', '--store', s.store]);
  t.is(forced.status, 0, forced.stderr);
  t.regex(forced.stdout, /broke the lease of .* on work: it drops the old work/);
  t.regex(forced.stdout, /replaced work with try-2; the old work's data stays in the store because forks or snapshots still use it\n/);
  // The serving host finds its lease gone, drops the old work; the next attach gets the new one.
  const end = Date.now() + 15_000;
  while (!/lease lost|was removed and created again/.test(s2.stderr()) && Date.now() < end) await new Promise((r) => setTimeout(r, 50));
  t.regex(s2.stderr(), /lease lost|was removed and created again/);
  await runOk('nbdcopy', [s2.uri('work'), path.join(dir, 'out.bin')]);
  t.deepEqual(fs.readFileSync(path.join(dir, 'out.bin')).subarray(0, MiB), attempt);
  t.deepEqual(lsNames(s.store), ['work']);
});

withNbdcopy('baton resize: grow while served (new connections see it), shrink only with --shrink, never past mapped data, never while served', async (t) => {
  const s = await startBatonServer(t, { volumes: [{ name: 'v', size: 8 * MiB }], extraArgs: ['--idle-grace', '60'] });
  const dir = tempDir(t);
  fs.writeFileSync(path.join(dir, 'in.bin'), Buffer.alloc(MiB, 0x61));
  await runOk('nbdcopy', ['--flush', path.join(dir, 'in.bin'), s.uri('v')]); // v is open there now
  t.is(ok(t, ['resize', 'v', '--size', '16M', '--store', s.store]), 'resized v from 8 MiB to 16 MiB; clients that attach from now on see the new size (reconnect a kernel client, then resize2fs)\n');
  const size = async (): Promise<number> => Number((await runOk('nbdinfo', ['--size', s.uri('v')])).stdout.trim());
  if (has('nbdinfo')) t.is(await size(), 16 * MiB, 'a new connection to the host serving it sees the new size');
  // Write at the very end of the grown volume, through the same server, and read it back.
  fs.writeFileSync(path.join(dir, 'tail.bin'), Buffer.alloc(16 * MiB, 0x62));
  await runOk('nbdcopy', ['--flush', path.join(dir, 'tail.bin'), s.uri('v')]);
  await runOk('nbdcopy', [s.uri('v'), path.join(dir, 'out.bin')]);
  t.true(fs.readFileSync(path.join(dir, 'out.bin')).equals(Buffer.alloc(16 * MiB, 0x62)));
  t.is(JSON.parse(ok(t, ['info', 'v', '--json', '--store', s.store])).size, 16 * MiB);

  const noFlag = baton(['resize', 'v', '--size', '4M', '--store', s.store]);
  t.is(noFlag.status, 2, noFlag.stderr);
  t.regex(noFlag.stderr, /would shrink it: add --shrink/);
  const served = baton(['resize', 'v', '--size', '4M', '--shrink', '--store', s.store]);
  t.is(served.status, 1, served.stderr);
  t.regex(served.stderr, /is being served by .*shrunk only while nobody serves it/);
  await s.stop();
  const mapped = baton(['resize', 'v', '--size', '4M', '--shrink', '--store', s.store]);
  t.is(mapped.status, 2, mapped.stderr);
  t.regex(mapped.stderr, /data mapped up to byte 16777216, past the new end 4194304/);
  t.is(JSON.parse(ok(t, ['info', 'v', '--json', '--store', s.store])).size, 16 * MiB, 'nothing changed');

  // Trim the tail, then the shrink goes through and the volume (and a fork of it) still reads.
  const s2 = await startBatonServer(t, { store: s.store, extraArgs: ['--idle-grace', '0.2'] });
  if (has('qemu-io')) {
    await runOk('qemu-io', ['-f', 'raw', '-c', `discard ${4 * MiB} ${12 * MiB}`, s2.uri('v')]);
    await s2.stop();
    ok(t, ['resize', 'v', '--size', '4M', '--shrink', '--store', s.store]);
    ok(t, ['fork', 'v', 'v2', '--store', s.store]);
    const s3 = await startBatonServer(t, { store: s.store });
    for (const n of ['v', 'v2']) {
      await runOk('nbdcopy', [s3.uri(n), path.join(dir, `${n}.bin`)]);
      t.true(fs.readFileSync(path.join(dir, `${n}.bin`)).equals(Buffer.alloc(4 * MiB, 0x62)), n);
    }
    await s3.stop();
  } else {
    t.log('qemu-io missing: the successful shrink was not exercised');
  }
  const bad = baton(['resize', 'v', '--size', 'lots', '--store', s.store]);
  t.is(bad.status, 2);
});

test('expiry: create/fork --expires, shown in ls and info; gc removes expired volumes nobody serves, never a served one; expire --never keeps one', async (t) => {
  const env = { BATON_MAX_OPERATION_MS: '1000' }; // gc waits M/2 for forks in creation
  const s = await startBatonServer(t, { volumes: [{ name: 'base', size: 4 * MiB }], extraArgs: ['--idle-grace', '60'], env });
  const run = (args: string[]): { status: number; stdout: string; stderr: string } => baton([...args, '--store', s.store], env);
  for (const [name, exp] of [['gone', '1s'], ['kept', '1s'], ['served', '1s'], ['later', '24h']] as const) {
    const r = run(['fork', 'base', name, '--expires', exp]);
    t.is(r.status, 0, r.stderr);
  }
  t.regex(run(['ls']).stdout, /^NAME\s+SIZE\s+STORED\s+WRITTEN\s+EXCLUSIVE\s+SHARED\s+CREATED\s+EXPIRES$/m);
  t.regex(run(['info', 'gone']).stdout, /expires: +\d{4}-.*baton expire gone --never keeps it/);
  t.is(run(['expire', 'kept', '--never']).stdout, 'kept never expires\n');
  const bad = run(['expire', 'kept']);
  t.is(bad.status, 2, bad.stderr);
  t.is(run(['create', 'x', '--size', '4M', '--expires', 'soon']).status, 2);
  if (has('nbdinfo')) await runOk('nbdinfo', [s.uri('served')]); // attached: its lease is held for the idle grace
  else t.log('nbdinfo missing: the served case is not exercised');
  await new Promise((r) => setTimeout(r, 1200));
  const gc = run(['gc', '--grace', '2s']);
  t.is(gc.status, 0, gc.stderr);
  t.regex(gc.stdout, /removed expired gone \(expired /);
  t.regex(gc.stderr, /"msg":"expired volume removed"/, 'logged');
  if (has('nbdinfo')) t.regex(gc.stdout, /expired served \(.*\) not removed: served/);
  const names = (JSON.parse(run(['ls', '--json']).stdout) as { name: string }[]).map((v) => v.name).sort();
  t.deepEqual(names, has('nbdinfo') ? ['base', 'kept', 'later', 'served'] : ['base', 'kept', 'later']);
});

const EXT4_TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'resize2fs', 'mount', 'umount'];
const canMount = process.getuid?.() === 0 && EXT4_TOOLS.every(has) && fs.existsSync('/dev/fuse') && fs.existsSync('/dev/loop-control');

(canMount ? test.serial : test.serial.skip)('baton resize + resize2fs: an ext4 volume grown while served, through nbdfuse + loop, keeps its files and gets the space', async (t) => {
  const { attachExport, detachExport, mountExt4, sha256File } = await import('../helpers/ext4.js');
  const s = await startBatonServer(t, { volumes: [{ name: 'fs', size: 64 * MiB }], extraArgs: ['--idle-grace', '60'] });
  const a = await attachExport(t, s.uri('fs'), tempDir(t, 'baton-fuse-'), 64 * MiB);
  await runOk('mkfs.ext4', ['-q', '-F', a.loop.dev], { timeoutMs: 60_000 });
  const mnt = tempDir(t, 'baton-mnt-');
  let m = await mountExt4(t, a.loop.dev, mnt);
  fs.writeFileSync(path.join(mnt, 'data.bin'), Buffer.alloc(8 * MiB, 0x63));
  const before = await sha256File(path.join(mnt, 'data.bin'));
  await detachExport(a, m);
  ok(t, ['resize', 'fs', '--size', '128M', '--store', s.store]);
  // The kernel client's way: reconnect (a new nbdfuse connection), then grow the filesystem.
  const b = await attachExport(t, s.uri('fs'), tempDir(t, 'baton-fuse-'), 128 * MiB);
  await runOk('e2fsck', ['-f', '-y', b.loop.dev], { timeoutMs: 60_000 });
  await runOk('resize2fs', [b.loop.dev], { timeoutMs: 60_000 });
  m = await mountExt4(t, b.loop.dev, mnt);
  const df = (await runOk('df', ['-B1', '--output=size', mnt])).stdout.trim().split('\n').pop()!;
  t.true(Number(df) > 100 * MiB, `ext4 is ${df} bytes after resize2fs`);
  t.is(await sha256File(path.join(mnt, 'data.bin')), before);
  await detachExport(b, m);
});

test('baton import / export: raw and qcow2 images in and out, checksums equal, only non-zero data written, progress as JSON lines', async (t) => {
  const { createHash, randomBytes } = await import('node:crypto');
  const { execFileSync } = await import('node:child_process');
  const store = storeIn(t);
  const dir = tempDir(t);
  const sha = (f: string): string => createHash('sha256').update(fs.readFileSync(f)).digest('hex');
  // 24 MiB with 3 MiB of random data in two places, zeroes elsewhere (written as zeroes, not a hole).
  const img = path.join(dir, 'disk.raw');
  const buf = Buffer.alloc(24 * MiB);
  randomBytes(2 * MiB).copy(buf, 1 * MiB);
  randomBytes(MiB).copy(buf, 20 * MiB + 512);
  fs.writeFileSync(img, buf);
  const imp = baton(['import', 'disk', img, '--json', '--store', store]);
  t.is(imp.status, 0, imp.stderr);
  const r = JSON.parse(imp.stdout) as { size: number; format: string; writtenBytes: number };
  t.is(r.format, 'raw');
  t.is(r.size, 24 * MiB);
  t.is(r.writtenBytes, 4 * MiB, 'the 1 MiB pieces holding data: 2 + 2 (the second region straddles two)');
  const lines = imp.stderr.trim().split('\n').map((l) => JSON.parse(l) as { volume: string; doneBytes: number; totalBytes: number; done: boolean });
  t.like(lines[lines.length - 1], { volume: 'disk', doneBytes: 24 * MiB, totalBytes: 24 * MiB, done: true });
  t.is(JSON.parse(ok(t, ['info', 'disk', '--json', '--store', store])).writtenBytes, 4 * MiB);

  const out = path.join(dir, 'out.raw');
  const exp = baton(['export', 'disk', out, '--store', store]);
  t.is(exp.status, 0, exp.stderr);
  t.is(sha(out), sha(img), 'exported bytes equal the image');
  t.true(fs.statSync(out).blocks * 512 < 8 * MiB, 'the export is sparse');

  const again = baton(['export', 'disk', out, '--store', store]);
  t.is(again.status, 1);
  t.regex(again.stderr, /exists: remove it, pick another path, or add --force/);
  t.is(baton(['export', 'disk', out, '--force', '--store', store]).status, 0);
  const dup = baton(['import', 'disk', img, '--store', store]);
  t.is(dup.status, 1);
  t.regex(dup.stderr, /already exists/);
  const missing = baton(['import', 'x', path.join(dir, 'nope.raw'), '--store', store]);
  t.is(missing.status, 2);
  t.regex(missing.stderr, /cannot read .*nope\.raw/);
  t.deepEqual(lsNames(store), ['disk'], 'failed imports left nothing');

  if (!has('qemu-img')) { t.log('qemu-img missing: qcow2 not exercised'); return; }
  const q = path.join(dir, 'disk.qcow2');
  execFileSync('qemu-img', ['convert', '-f', 'raw', '-O', 'qcow2', img, q]);
  const qi = baton(['import', 'fromq', q, '--json', '--store', store]);
  t.is(qi.status, 0, qi.stderr);
  t.like(JSON.parse(qi.stdout), { format: 'qcow2', size: 24 * MiB, writtenBytes: 4 * MiB });
  t.deepEqual(fs.readdirSync(dir).filter((f) => f.includes('baton-import')), [], 'the temporary raw file is gone');
  const outq = path.join(dir, 'out.qcow2');
  t.is(baton(['export', 'fromq', outq, '--format', 'qcow2', '--store', store]).status, 0);
  t.notThrows(() => execFileSync('qemu-img', ['compare', img, outq]), 'qemu-img compare: identical');
  const out2 = path.join(dir, 'out2.raw');
  t.is(baton(['export', 'fromq', out2, '--store', store]).status, 0);
  t.is(sha(out2), sha(img));
});
