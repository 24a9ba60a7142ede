/**
 * Garbage collection end to end, on a real ext4 (nbdfuse + loop + mount on a `baton serve`
 * process, `file:` store), with the real `baton gc`:
 *
 * 1. TRIM reclaim: 1 GiB written into ext4 (mounted -o discard) and deleted: the online
 *    discards unmap it (loop -> nbdfuse punch-hole -> NBD TRIM); then fstrim and
 *    `baton gc --compact`: the store's bytes for the volume drop to near its live data
 *    (goal: <= 1.25x), the file system stays clean and the kept files read back.
 * 2. On S3 (radosgw): data overwritten after a fork is collected, what the fork and the
 *    parent map survives and reads back through a new server.
 * 3. Background: a served volume whose data was overwritten is compacted and collected by
 *    `baton serve --gc-interval` while a client stays attached and keeps reading correctly.
 *
 * Every baton process runs with BATON_MAX_OPERATION_MS=1000 so the grace can be 2 s.
 */

import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { attachExport, detachExport, mountExt4, run, runOk, sha256File } from '../helpers/ext4.js';
import { GC_TEST_ENV, gcUntilQuiet, storeObjectBytes } from '../helpers/gc.js';
import { hasS3, makeTestBucket, s3TestEnv } from '../helpers/s3.js';
import { BATON_BIN, baton, has, startBatonServer, tempDir, type BatonServer } from '../helpers/server.js';

const MiB = 1024 * 1024;
const GiB = 1024 * MiB;
const TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'mount', 'umount', 'fstrim', 'dd'];
const missing = TOOLS.filter((tool) => !has(tool));
const canMount = process.getuid?.() === 0 && missing.length === 0 && fs.existsSync('/dev/fuse') && fs.existsSync('/dev/loop-control');
const serial = canMount ? test.serial : test.serial.skip;
if (!canMount) console.warn(`gc (ext4 tests): skipped (missing tools: ${missing.join(', ') || 'none'}, root: ${process.getuid?.() === 0})`);
const canQemu = has('qemu-io');
const withQemu = canQemu ? test : test.skip;

interface VolJson { name: string; storedBytes: number; writtenBytes?: number }

async function cliJson<T>(args: string[]): Promise<T> {
  const r = await run(process.execPath, [BATON_BIN, ...args, '--json'], { timeoutMs: 120_000, env: GC_TEST_ENV });
  if (r.code !== 0) throw new Error(`baton ${args.join(' ')} exited ${r.code ?? r.signal}: ${r.output}`);
  return JSON.parse(r.stdout) as T;
}

async function volume(store: string, name: string): Promise<VolJson> {
  const v = (await cliJson<VolJson[]>(['ls', '--store', store])).find((x) => x.name === name);
  if (!v) throw new Error(`${name} is not in baton ls`);
  return v;
}

function serverOn(t: ExecutionContext, store: string, extra: string[], volumes: { name: string; size: number }[] = []): Promise<BatonServer> {
  return startBatonServer(t, { store, volumes, env: GC_TEST_ENV, extraArgs: ['--cache-dir', tempDir(t, 'baton-gc-cache-'), '--idle-grace', '0.2', ...extra] });
}

async function waitUntil(what: string, cond: () => Promise<boolean>, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

serial('TRIM reclaim: 1 GiB written and deleted in ext4, fstrim, gc: the store keeps about the live data', async (t) => {
  const SIZE = 2 * GiB;
  const store = `file:${path.join(tempDir(t, 'baton-gc-store-'), 'store')}`;
  const A = await serverOn(t, store, [], [{ name: 'tv', size: SIZE }]);
  const mnt = tempDir(t, 'baton-gc-mnt-');
  let s = await attachExport(t, A.uri('tv'), tempDir(t, 'baton-gc-fuse-'), SIZE);
  await runOk('mkfs.ext4', ['-q', '-F', s.loop.dev], { timeoutMs: 120_000 });
  // -o discard: ext4 discards freed blocks as it commits (the `rm -rf node_modules` case); fstrim
  // below then covers whatever is left.
  let m = await mountExt4(t, s.loop.dev, mnt, 'discard');
  // What stays: 200 files of 4-200 KiB.
  const kept = new Map<string, string>();
  await fsp.mkdir(path.join(mnt, 'keep'));
  for (let i = 0; i < 200; i++) {
    const f = path.join(mnt, 'keep', `f${i}`);
    await fsp.writeFile(f, randomBytes(4096 + ((i * 7919) % 200) * 1024));
    kept.set(`f${i}`, await sha256File(f));
  }
  await runOk('dd', ['if=/dev/urandom', `of=${path.join(mnt, 'big')}`, 'bs=4M', 'count=256', 'conv=fsync', 'status=none'], { timeoutMs: 600_000 });
  await runOk('sync', []);
  const full = await volume(store, 'tv');
  t.true(full.storedBytes >= GiB, `1 GiB is in the store (${full.storedBytes})`);

  await fsp.rm(path.join(mnt, 'big'));
  // ext4 issues a transaction's discards after committing it: a later journal commit (sync)
  // brings them to the store with its FLUSH.
  let discarded = full;
  await waitUntil('online discard to reach the store', async () => {
    await runOk('sync', ['-f', mnt]);
    discarded = await volume(store, 'tv');
    return (full.writtenBytes ?? 0) - (discarded.writtenBytes ?? 0) >= 900 * MiB;
  }, 30_000);
  t.log(`written (mapped) bytes: ${full.writtenBytes} with the file, ${discarded.writtenBytes} after rm + sync on a discard mount`);
  const trimmed = await runOk('fstrim', ['-v', mnt], { timeoutMs: 120_000 });
  t.log(`fstrim: ${trimmed.stdout.trim()}`);
  await detachExport(s, m);
  await waitUntil('the server to close the volume', async () => /"msg":"volume closed"/.test(A.stderr()));

  const runs = await gcUntilQuiet(store, { firstRun: ['--compact'] });
  const after = await volume(store, 'tv');
  const live = after.writtenBytes ?? 0;
  const amp = after.storedBytes / live;
  t.log(`before: ${full.storedBytes} stored; after fstrim + gc: ${after.storedBytes} stored for ${live} live (${amp.toFixed(3)}x); runs: ${runs.map((r) => `deleted ${r.deletedObjects} (${r.deletedBytes} B)`).join(', ')}; compacted: ${JSON.stringify(runs[0]?.compacted)}`);
  t.true(live > 0 && live < 256 * MiB, `live data is the kept files and ext4 metadata (${live})`);
  t.true(amp <= 1.25, `space amplification ${amp.toFixed(3)}x <= 1.25x`);
  t.true(after.storedBytes < full.storedBytes / 4, 'the deleted GiB is gone from the store');

  s = await attachExport(t, A.uri('tv'), tempDir(t, 'baton-gc-fuse-'), SIZE);
  const fsck = await run('e2fsck', ['-fn', s.loop.dev], { timeoutMs: 120_000 });
  t.is(fsck.code, 0, `e2fsck after gc: ${fsck.output}`);
  m = await mountExt4(t, s.loop.dev, mnt, 'ro');
  for (const [name, hash] of kept) t.is(await sha256File(path.join(mnt, 'keep', name)), hash, `keep/${name}`);
  t.false(fs.existsSync(path.join(mnt, 'big')));
  await detachExport(s, m);
  await A.stop();
  t.is(A.proc.exitCode, 0, A.stderr());
});

withQemu('background: a served volume is compacted and collected while its client keeps reading', async (t) => {
  const store = `file:${path.join(tempDir(t, 'baton-gc-store-'), 'store')}`;
  // Objects are 1 MiB (segment) or smaller (inline): overwrite 3/4 of each MiB so all are mostly dead.
  // Uncompressed (the patterns below would compress to nothing): stored bytes follow live bytes.
  const made = baton(['create', 'bg', '--size', String(64 * MiB), '--compression', 'none', '--store', store], GC_TEST_ENV);
  t.is(made.status, 0, made.stderr);
  const A = await serverOn(t, store, ['--gc-interval', '2.5s', '--gc-grace', '2s', '--compact-below', '0.5']);
  const uri = A.uri('bg');
  const io = async (cmds: string[]): Promise<string> => (await runOk('qemu-io', ['-f', 'raw', ...cmds.flatMap((c) => ['-c', c]), uri], { timeoutMs: 120_000 })).stdout;
  await io(['write -P 0x11 0 32M', 'flush']);
  const cmds: string[] = [];
  for (let off = 0; off < 32 * MiB; off += MiB) cmds.push(`write -P 0x22 ${off} 768k`);
  await io([...cmds, 'flush']);
  const before = await storeObjectBytes(store);
  t.true(before >= 56 * MiB, `stored ${before}`);
  // A client stays attached (the volume stays served: background passes run) and reads.
  const reader = new AbortController();
  let reads = 0;
  const readLoop = (async () => {
    while (!reader.signal.aborted) {
      const out = await io(['read -P 0x22 0 768k', 'read -P 0x11 768k 256k', `read -P 0x22 ${31 * MiB} 768k`, `read -P 0x11 ${31 * MiB + 768 * 1024} 256k`]);
      if (/Pattern verification failed/i.test(out)) throw new Error(`read wrong data: ${out}`);
      reads++;
    }
  })();
  // qemu-io connects per run; keep one connection open too so the volume never goes idle.
  const holder = (async () => {
    await run('qemu-io', ['-f', 'raw', '-c', 'read 0 4k', '-c', 'sleep 20000', '-c', 'read -P 0x22 0 4k', uri], { timeoutMs: 60_000 });
  })();
  try {
    await waitUntil('background GC to delete the dead bytes', async () => (await storeObjectBytes(store)) < 0.6 * before, 40_000);
  } finally {
    reader.abort();
  }
  await readLoop;
  await holder;
  const after = await storeObjectBytes(store);
  t.log(`background pass: ${before} -> ${after} bytes stored for 32 MiB live; ${reads} verified read rounds meanwhile`);
  t.true(after <= 1.25 * 32 * MiB + 4 * MiB, `stored ${after}`);
  t.true(reads > 0);
  t.regex(A.stderr(), /"msg":"compacted"/);
  await io(['read -P 0x22 0 768k', 'read -P 0x11 768k 256k', 'read -P 0x22 16M 768k']);
  await A.stop();
  t.is(A.proc.exitCode, 0, A.stderr());
});

(canQemu && hasS3() ? test : test.skip)('on S3 (radosgw): overwritten data is collected, what a fork and the parent map survives', async (t) => {
  const s3 = await s3TestEnv(t);
  const bucket = await makeTestBucket(s3);
  const store = `s3://${bucket}/gc`;
  const storeArgs = ['--endpoint', s3.endpoint];
  const env = { AWS_ACCESS_KEY_ID: s3.accessKeyId, AWS_SECRET_ACCESS_KEY: s3.secretAccessKey, AWS_REGION: s3.region, BATON_HOME: tempDir(t, 'baton-gc-home-'), ...GC_TEST_ENV };
  const cli = async (args: string[]): Promise<string> => {
    const r = await run(process.execPath, [BATON_BIN, ...args, '--store', store, ...storeArgs], { timeoutMs: 120_000, env });
    if (r.code !== 0) throw new Error(`baton ${args.join(' ')}: ${r.output}`);
    return r.stdout;
  };
  const start = () => startBatonServer(t, { store, env, volumes: [], extraArgs: [...storeArgs, '--cache-dir', tempDir(t, 'baton-gc-cache-'), '--idle-grace', '0.2'] });
  await cli(['create', 'p', '--size', '64M', '--compression', 'none']); // byte counts below are the data's (qemu-io patterns compress to nothing)
  let A = await start();
  const io = async (name: string, cmds: string[]): Promise<string> => (await runOk('qemu-io', ['-f', 'raw', ...cmds.flatMap((c) => ['-c', c]), A.uri(name)], { timeoutMs: 120_000 })).stdout;
  await io('p', ['write -P 0xa1 0 16M', 'flush']);
  await cli(['fork', 'p', 'f']);
  await io('p', ['write -P 0xb2 0 16M', 'flush']); // dead after the next write: nothing maps it
  await io('p', ['write -P 0xc3 0 16M', 'flush']);
  await A.stop();
  const stored = async (): Promise<number> => (JSON.parse(await cli(['ls', '--json'])) as VolJson[]).find((v) => v.name === 'p')!.storedBytes;
  const before = await stored();
  t.true(before >= 48 * MiB, `three generations stored (${before})`);
  const runs = await gcUntilQuiet(store, { storeArgs, env });
  const after = await stored();
  t.log(`radosgw: parent stored ${before} -> ${after} bytes; runs: ${runs.map((r) => `marked ${r.markedObjects}, deleted ${r.deletedObjects}`).join('; ')}`);
  t.true(before - after >= 16 * MiB - 64 * 1024, 'the overwritten 16 MiB generation is gone');
  t.true(after >= 32 * MiB, 'the fork\'s and the parent\'s data stay');
  A = await start();
  t.notRegex(await io('f', ['read -P 0xa1 0 16M']), /fail/i);
  t.notRegex(await io('p', ['read -P 0xc3 0 16M']), /fail/i);
  await A.stop();
  t.is(A.proc.exitCode, 0, A.stderr());
});
