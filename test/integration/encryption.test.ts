/**
 * Encryption at rest end to end on Ceph radosgw (issue 16), with real `baton` processes and
 * real clients:
 *
 * 1. `baton create --encrypt --key-file`, `baton serve` with BATON_KEY_FILE: ext4 through
 *    nbdfuse + loop (mkfs, files holding a secret, fsync, umount, e2fsck); no object in the
 *    bucket holds the secret (a plain volume written the same way does: the check can fail).
 * 2. A snapshot and a fork (which needs the key): the snapshot reads the old image byte for
 *    byte (nbdcopy), the fork mounts, sees the files, takes writes of its own, e2fsck clean.
 * 3. No key and another key: the attach is refused with a message naming the key id (nbdinfo
 *    fails), never a device of garbage; `baton ls`/`info` still work without a key.
 * 4. A tampered object: one bit of a segment flipped in the bucket; reading the whole device
 *    (nbdcopy) fails with an I/O error, and the server's log names the object.
 */

import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { GetObjectCommand, ListObjectsV2Command, PutObjectCommand } from '@aws-sdk/client-s3';
import { keys } from '../../src/volume/format.js';
import { attachExport, detachExport, mountExt4, run, runOk, sha256File } from '../helpers/ext4.js';
import { hasRgw, makeTestBucket, s3Client, s3TestEnv, type S3TestEnv } from '../helpers/s3.js';
import { baton, has, startBatonServer, tempDir } from '../helpers/server.js';

const MiB = 1024 * 1024;
const SIZE = 256 * MiB;
const SECRET = 'GITHUB_TOKEN=ghp_baton16secretZZqv7Lw3xY9aBcDeFgHiJkLmNoPq';
const TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'mount', 'umount', 'nbdcopy', 'nbdinfo'];
const missing = TOOLS.filter((x) => !has(x));
const ok = process.getuid?.() === 0 && missing.length === 0 && fs.existsSync('/dev/fuse') && hasRgw();
const serial = ok ? test.serial : test.serial.skip;
if (!ok) console.warn(`encryption (rgw, ext4): skipped (root: ${process.getuid?.() === 0}, missing: ${missing.join(', ') || 'none'}, radosgw: ${hasRgw()})`);

interface Target { store: string; bucket: string; prefix: string; env: Record<string, string>; s3: S3TestEnv }

async function rgwTarget(t: ExecutionContext): Promise<Target> {
  const e = await s3TestEnv(t);
  const bucket = await makeTestBucket(e);
  return {
    store: `s3://${bucket}/enc`, bucket, prefix: 'enc/', s3: e,
    env: { AWS_ACCESS_KEY_ID: e.accessKeyId, AWS_SECRET_ACCESS_KEY: e.secretAccessKey, AWS_REGION: e.region, BATON_S3_ENDPOINT: e.endpoint },
  };
}

function batonOk(args: string[], env: Record<string, string>): string {
  const r = baton(args, env);
  if (r.status !== 0) throw new Error(`baton ${args.join(' ')} exited ${r.status}: ${r.stderr}`);
  return r.stdout;
}

/** Every object of the bucket under the prefix, with its bytes. */
async function bucketObjects(tg: Target): Promise<{ key: string; body: Buffer }[]> {
  const c = s3Client(tg.s3);
  try {
    const out: { key: string; body: Buffer }[] = [];
    let token: string | undefined;
    do {
      const r = await c.send(new ListObjectsV2Command({ Bucket: tg.bucket, Prefix: tg.prefix, ContinuationToken: token }));
      for (const o of r.Contents ?? []) {
        const g = await c.send(new GetObjectCommand({ Bucket: tg.bucket, Key: o.Key! }));
        out.push({ key: o.Key!, body: Buffer.from(await g.Body!.transformToByteArray()) });
      }
      token = r.IsTruncated ? r.NextContinuationToken : undefined;
    } while (token);
    return out;
  } finally {
    c.destroy();
  }
}

async function putObject(tg: Target, key: string, body: Buffer): Promise<void> {
  const c = s3Client(tg.s3);
  try { await c.send(new PutObjectCommand({ Bucket: tg.bucket, Key: key, Body: body })); } finally { c.destroy(); }
}

/** mkfs.ext4, files holding the secret (fsync'd), umount, e2fsck: returns the files' contents. */
async function fillExt4(t: ExecutionContext, uri: string): Promise<Map<string, Buffer>> {
  const s = await attachExport(t, uri, tempDir(t, 'baton-fuse-'), SIZE);
  await runOk('mkfs.ext4', ['-q', '-F', s.loop.dev], { timeoutMs: 120_000 });
  const mnt = tempDir(t, 'baton-mnt-');
  const m = await mountExt4(t, s.loop.dev, mnt);
  const files = new Map<string, Buffer>();
  await fsp.mkdir(path.join(mnt, 'repo'));
  for (let i = 0; i < 40; i++) {
    // Source-like text with the secret in it, and some incompressible bytes.
    const body = i % 4 === 3 ? randomBytes(256 * 1024) : Buffer.from(`// file ${i}\nexport const env = "${SECRET}";\n`.repeat(2000 + i * 50));
    const f = path.join('repo', `f${i}.ts`);
    await fsp.writeFile(path.join(mnt, f), body);
    files.set(f, body);
  }
  await runOk('sync', []);
  await detachExport(s, m);
  const s2 = await attachExport(t, uri, tempDir(t, 'baton-fuse-'), SIZE);
  const fsck = await run('e2fsck', ['-fn', s2.loop.dev], { timeoutMs: 120_000 });
  await detachExport(s2);
  t.is(fsck.code, 0, `e2fsck: ${fsck.output}`);
  return files;
}

async function checkFiles(t: ExecutionContext, uri: string, files: Map<string, Buffer>, writeMore: boolean): Promise<void> {
  const s = await attachExport(t, uri, tempDir(t, 'baton-fuse-'), SIZE);
  const mnt = tempDir(t, 'baton-mnt-');
  const m = await mountExt4(t, s.loop.dev, mnt);
  for (const [f, body] of files) t.true((await fsp.readFile(path.join(mnt, f))).equals(body), f);
  if (writeMore) {
    await fsp.writeFile(path.join(mnt, 'repo', 'fork-only.txt'), `fork ${SECRET}\n`.repeat(1000));
    await runOk('sync', []);
  }
  await detachExport(s, m);
  const s2 = await attachExport(t, uri, tempDir(t, 'baton-fuse-'), SIZE);
  const fsck = await run('e2fsck', ['-fn', s2.loop.dev], { timeoutMs: 120_000 });
  await detachExport(s2);
  t.is(fsck.code, 0, `e2fsck: ${fsck.output}`);
}

async function imageSha(t: ExecutionContext, uri: string): Promise<string> {
  const out = path.join(tempDir(t, 'baton-img-'), 'img');
  await runOk('nbdcopy', [uri, out], { timeoutMs: 120_000 });
  return sha256File(out);
}

serial('encrypted volume on radosgw: ext4, no plaintext in the bucket, snapshot and fork read, fork writes; wrong or no key refused; a tampered object is EIO naming it', async (t) => {
  const tg = await rgwTarget(t);
  const dir = tempDir(t, 'baton-keys-');
  const keyFile = path.join(dir, 'master.key');
  await fsp.writeFile(keyFile, randomBytes(32), { mode: 0o600 });
  const otherKey = path.join(dir, 'other.key');
  await fsp.writeFile(otherKey, randomBytes(32).toString('hex'));
  const withKey = { ...tg.env, BATON_KEY_FILE: keyFile };

  batonOk(['create', 'sec', '--size', String(SIZE), '--encrypt', '--key-file', keyFile, '--store', tg.store], tg.env);
  batonOk(['create', 'plain', '--size', String(SIZE), '--store', tg.store], tg.env);
  const info = JSON.parse(batonOk(['info', 'sec', '--json', '--store', tg.store], tg.env)) as { data: { encrypted: boolean; keyId: string } };
  t.true(info.data.encrypted, 'info without a key: encrypted, with its key id');

  // 1. ext4 on the encrypted volume and on a plain one, the same files.
  let srv = await startBatonServer(t, { store: tg.store, env: withKey, extraArgs: ['--idle-grace', '1'] });
  const files = await fillExt4(t, srv.uri('sec'));
  await fillExt4(t, srv.uri('plain'));
  const before = await imageSha(t, srv.uri('sec'));
  await srv.stop();
  const objs = await bucketObjects(tg);
  const idOf = (name: string): string => (JSON.parse(objs.find((o) => o.key === tg.prefix + keys.volumeRecord(name))!.body.toString()) as { id: string }).id;
  const plainId = idOf('plain');
  const secId = idOf('sec');
  const hold = (o: { body: Buffer }): boolean => o.body.includes(SECRET.slice(13, 40));
  t.true(objs.some(hold), 'the check can fail: the plain volume\'s objects hold the secret');
  const leaking = objs.filter(hold).map((o) => o.key).filter((k) => !k.includes(plainId));
  t.true(objs.some((o) => o.key.includes(`vol/${secId}/seg/`)), 'the encrypted volume has segments');
  t.log(`${objs.length} objects in the bucket, ${objs.filter(hold).length} hold the secret: ${objs.filter(hold).slice(0, 3).map((o) => o.key).join(', ')}`);
  t.true(JSON.parse(batonOk(['ls', '--json', '--store', tg.store], tg.env)).length >= 2, 'ls without a key');
  // Every object holding the secret belongs to the plain volume (its id is in the key).
  t.deepEqual(leaking, [], 'no object of the encrypted volume holds the secret');

  // 2. Snapshot (no key needed: it writes no data) and fork (needs the key).
  batonOk(['snapshot', 'sec', 's1', '--store', tg.store], tg.env);
  const noKeyFork = baton(['fork', 'sec', 'nokey', '--store', tg.store], tg.env);
  t.not(noKeyFork.status, 0);
  t.regex(noKeyFork.stderr, /encrypted.*key/);
  batonOk(['fork', 'sec', 'f', '--store', tg.store], withKey);
  srv = await startBatonServer(t, { store: tg.store, env: withKey, extraArgs: ['--idle-grace', '1'] });
  t.is(await imageSha(t, srv.uri('sec@s1')), before, 'the snapshot reads the image byte for byte');
  await checkFiles(t, srv.uri('f'), files, true);
  await checkFiles(t, srv.uri('sec'), files, false);
  await srv.stop();
  const after = await bucketObjects(tg);
  t.true(after.length > objs.length, 'the fork wrote objects');
  t.deepEqual(after.filter(hold).map((o) => o.key).filter((k) => !k.includes(plainId)), [], 'the fork\'s objects hold no plaintext either');

  // 3. No key, another key: refused at attach, with the reason.
  for (const [label, env] of [['no key', tg.env], ['another key', { ...tg.env, BATON_KEY_FILE: otherKey }]] as const) {
    const s = await startBatonServer(t, { store: tg.store, env });
    const r = await run('nbdinfo', [s.uri('sec')], { timeoutMs: 30_000 });
    t.not(r.code, 0, `${label}: nbdinfo must fail`);
    await s.stop();
    t.regex(s.stderr(), new RegExp(`encrypted.*${info.data.keyId}`), `${label}: the server logs why, naming the key id`);
  }

  // 4. Tamper with one segment of the encrypted volume (one bit), then read everything.
  const segs = after.filter((o) => o.key.includes(`vol/${secId}/seg/`));
  t.true(segs.length > 0, 'the encrypted volume has segments');
  const victim = segs[0]!;
  const bad = Buffer.from(victim.body);
  bad[Math.floor(bad.length / 2)]! ^= 0x08;
  await putObject(tg, victim.key, bad);
  srv = await startBatonServer(t, { store: tg.store, env: withKey });
  const out = path.join(tempDir(t, 'baton-img-'), 'img');
  const r = await run('nbdcopy', [srv.uri('sec'), out], { timeoutMs: 120_000 });
  t.not(r.code, 0, 'reading the tampered object fails');
  t.regex(r.output, /Input\/output error|EIO|error/i);
  await srv.stop();
  t.true(srv.stderr().includes(victim.key.slice(tg.prefix.length)), 'the server log names the object');
  t.regex(srv.stderr(), /failed its check/);
  await putObject(tg, victim.key, victim.body);
  srv = await startBatonServer(t, { store: tg.store, env: withKey });
  await imageSha(t, srv.uri('sec')); // restored: the whole device reads again (nbdcopy exits 0)
  await srv.stop();
});
